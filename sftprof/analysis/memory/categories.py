"""Where a block alive at a snapshot's peak comes from: its allocation site (the innermost frame of this project or
a library, :func:`allocation_site`) and the memory category of that site (:func:`site_category`: parameters,
gradients, optimizer state, workspaces, activations, allocated before the recorded window).
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["allocation_site", "site_category", "categories", "MEMORY_CATEGORIES"]

_GIB = float(2**30)

# Category of a block alive at the peak, from its allocation site (first match wins). Line numbers of
# megatron-core's _ParamAndGradBuffer are those of the pinned megatron-core 0.16.1
# (distributed/param_and_grad_buffer.py: param_data at line 797, grad_data at 803).
MEMORY_CATEGORIES = {
    "parameters": "parameters (model weights, param buffers)",
    "gradients": "gradient buffers",
    "optimizer": "optimizer state and step buffers (main params or TE FusedAdam's 16-bit remainders, moments, "
                 "fp32 main grads)",
    "workspaces": "library workspaces (cuBLAS / Transformer Engine GEMM workspaces)",
    "activations": "activations and autograd temporaries",
    "before_window": "allocated before the recorded window (stack unknown)",
}

_CATEGORY_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("before_window", re.compile(r"^<allocated before the recorded window>$")),
    ("gradients", re.compile(r"param_and_grad_buffer\.py:(80[3-9]|81\d) |\bgrad_data\b|main_grad")),
    ("parameters", re.compile(r"param_and_grad_buffer\.py:(7[89]\d|80[0-2]) |\bparam_data\b|reset_parameters|"
                              r"_initialize_affine_weight|\b__init__$|init_method|_load_hf_checkpoint|safetensors")),
    ("optimizer", re.compile(r"(^|/)optimizer/|optim|adam", re.IGNORECASE)),
    ("workspaces", re.compile(r"workspace", re.IGNORECASE)),
)

_STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages|dist-packages)")
_TORCH = re.compile(r"(^|/)torch/")
_AUTOGRAD_NODE = re.compile(r"torch::autograd::generated::(\w+)::apply")
_SHORTEN = re.compile(r"^(?:.*?/)?(?:site-packages|dist-packages)/")

_PACKAGE_ROOT = re.compile(r"^.*?/(?=(?:sftprof|megatron|transformers|torch|liger_kernel|cut_cross_entropy|"
                           r"transformer_engine|triton|apex|flash_attn)/)")


def _short_path(filename: str) -> str:
    """Path from the package root for installed libraries and this project (``megatron/core/...``)."""
    return _PACKAGE_ROOT.sub("", _SHORTEN.sub("", filename))


def allocation_site(frames: list[dict[str, Any]]) -> str:
    """Group key of one allocation from its stack (``frames`` innermost first).

    Returns ``"<file>:<line> <function>"`` of the innermost Python frame outside PyTorch and the
    standard library (``site-packages/`` prefixes removed); when an autograd node
    (``torch::autograd::generated::XBackward0``) sits inside that frame the key becomes
    ``"XBackward0 (autograd) via <file>:<line> <function>"``. Falls back to the innermost
    Python frame, then to ``"<no Python frame>"``.
    """
    node = None
    first_py = None
    for f in frames:
        if not isinstance(f, dict):
            continue
        fn = f.get("filename")
        fn = fn if isinstance(fn, str) else ""
        if not fn.endswith(".py"):
            if node is None:
                m = _AUTOGRAD_NODE.search(str(f.get("name") or ""))
                if m:
                    node = m.group(1)
            continue
        site = f"{_short_path(fn)}:{f.get('line', 0)} {f.get('name', '?')}"
        if first_py is None:
            first_py = site
        if _TORCH.search(fn) or _STDLIB.search(fn) or fn.startswith("<"):
            continue
        return f"{node} (autograd) via {site}" if node else site
    if first_py is not None:
        return f"{node} (autograd) via {first_py}" if node else first_py
    return f"{node} (autograd)" if node else "<no Python frame>"


def site_category(site: str) -> str:
    """Category key of :data:`MEMORY_CATEGORIES` for an allocation site (:func:`allocation_site`).

    Rules (first match): stack unknown -> ``before_window``; megatron-core gradient buffers ->
    ``gradients``; parameter buffers and module ``__init__``/weight-init frames -> ``parameters``;
    optimizer code (``optimizer/``, ``optim``, ``adam``: TE's FusedAdam too) -> ``optimizer``; GEMM workspaces
    (TE's ``get_cublas_workspace``) -> ``workspaces``; anything else, allocated while the step ran, ->
    ``activations``.
    """
    for key, pattern in _CATEGORY_RULES:
        if pattern.search(site):
            return key
    return "activations"


def categories(by_site: dict[str, list[int]], peak: int, reserved: int) -> list[dict[str, Any]]:
    """Bytes alive at the peak per category (sum = allocated at the peak) plus allocator slack."""
    tot: dict[str, list[int]] = {k: [0, 0] for k in MEMORY_CATEGORIES}
    for site, (b, c) in by_site.items():
        t = tot[site_category(site)]
        t[0] += b
        t[1] += c
    rows = [{"category": k, "label": MEMORY_CATEGORIES[k], "bytes": b, "gib": round(b / _GIB, 4), "blocks": c,
             "share_pct": round(100 * b / peak, 3) if peak else 0.0} for k, (b, c) in tot.items()]
    rows.append({"category": "allocator_slack", "label": "allocator slack (reserved - allocated)",
                 "bytes": reserved - peak, "gib": round((reserved - peak) / _GIB, 4), "blocks": None, "share_pct": None})
    return rows
