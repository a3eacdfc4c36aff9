"""Model-part regions in kernel traces: ``record_function`` ranges opened by module forward hooks.

An engine registers its model once (:func:`register_model`); while a kernel profiler records a step
(:func:`recording`, entered by :class:`sftprof.capture.kernel.KernelProfiler`) global module hooks
open a ``torch.profiler.record_function`` range when a registered module's forward starts and close it
when it ends, so every kernel launched inside shows which model part and layer launched it. Outside
recorded steps no hook is installed (no cost).

Range names (``user_annotation`` events)::

    sftprof.module/<part>/L<layer>                 first-pass forward
    sftprof.module/<part>/L<layer>/recompute       forward re-run by activation recompute
    sftprof.module/<part>                          parts outside the decoder layers

``<layer>`` is the 0-based global decoder-layer index (megatron-core's ``layer_number - 1``, which
counts the pipeline stage's offset; the index in ``model.layers`` for Hugging Face models). A forward
is a recompute when it runs inside a backward pass: megatron-core's full recompute
(``CheckpointFunction.backward``) and torch's non-reentrant checkpoint (Hugging Face gradient
checkpointing) both re-run the forward while autograd executes a graph task, which
``torch._C._current_graph_task_id()`` reports (``-1`` outside any backward).

Parts (:data:`PARTS`) come from the module's path in ``named_modules()`` (:func:`module_part`):
megatron-core's ``GPTModel`` (``decoder.layers.<i>.self_attention.linear_qkv``, ``.core_attention``,
``.linear_proj``, ``.q_layernorm``/``.k_layernorm``, ``input_layernorm``, ``pre_mlp_layernorm``,
``mlp`` (``MoELayer``), ``mlp.router``, ``mlp.experts``, ``mlp.shared_experts``, ``embedding``,
``decoder.final_layernorm``, ``output_layer``, the engine's ``lm_head_loss``) and Hugging Face
Qwen3-MoE / Qwen3.5-MoE models (``model.layers.<i>.self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``,
``linear_attn``, ``mlp.gate``, ``mlp.experts``, ``mlp.shared_expert``, ``model.embed_tokens``,
``model.norm``, ``lm_head``). Qwen3.5's gated delta-net layers are the part ``linear_attn`` (Hugging Face's
``linear_attn`` module; megatron-core's ``GatedDeltaNet`` at ``self_attention``, whose ``in_proj`` /
``out_proj`` / ``out_norm`` count as QKV projection, output projection and norms), so a summary shows
linear-attention and full-attention layers apart. Time that a part's module spends outside its registered
children is its own: the ``MoELayer``'s own kernels (permutation, all-to-all, unpermutation) are the token
dispatch/combine, the self-attention module's own kernels are RoPE and reshapes (``attn_other``;
for Hugging Face models, whose attention core is a function, the analysis moves attention kernels of
``attn_other`` to ``attn_core``).
"""
from __future__ import annotations

import contextlib
import re
import weakref
from typing import Iterator, Optional

import torch

from sftprof.artifacts import (MODEL_PART_LABELS as PART_LABELS, MODEL_PARTS as PARTS, MODULE_REGION_PREFIX as PREFIX,
                               module_region_name as region_name, parse_module_region as parse_region)

__all__ = ["PREFIX", "PARTS", "PART_LABELS", "module_part", "region_name", "parse_region", "register_model",
           "part_range", "recording", "registered_modules"]

# (regex on the path below a decoder layer, part); first match wins.
_LAYER_RULES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), part) for p, part in (
    (r"^(self_attention|self_attn)\.(linear_qkv|q_proj|k_proj|v_proj|linear_q|linear_kv|in_proj)$", "attn_qkv"),
    (r"^(self_attention|self_attn)\.core_attention$", "attn_core"),
    (r"^linear_attn$", "linear_attn"),  # Qwen3.5 gated delta-net layers (HF): the whole token mixer
    (r"^(self_attention|self_attn)\.(linear_proj|o_proj|out_proj)$", "attn_out"),
    (r"^self_attention\.out_norm$", "norm"),  # megatron-core GatedDeltaNet's gated norm over value heads
    (r"^(self_attention|self_attn)$", "attn_other"),
    (r"(^|\.)(input_layernorm|pre_mlp_layernorm|post_attention_layernorm|q_layernorm|k_layernorm|q_norm|k_norm)$",
     "norm"),
    (r"^mlp\.(router|gate)$", "router"),
    (r"^mlp\.experts$", "experts"),
    (r"^mlp\.(shared_experts|shared_expert|shared_expert_gate)$", "shared_experts"),
    (r"^mlp$", "dispatch_combine"),
    (r"^$", "layer_other"),
))
_TOP_RULES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), part) for p, part in (
    (r"(^|\.)(embedding|embed_tokens)$", "embedding"),
    (r"(^|\.)(final_layernorm|norm)$", "norm"),
    (r"(^|\.)(output_layer|lm_head|lm_head_loss)$", "lm_head_loss"),
))
_LAYER_PATH = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\.(.*))?$")


def module_part(path: str, module: Optional[torch.nn.Module] = None) -> Optional[tuple[str, Optional[int]]]:
    """``(part, local layer index or None)`` of a module path from ``named_modules()``, or None.

    ``module`` (optional) refines the part by class: megatron-core's ``GatedDeltaNet`` sits at
    ``self_attention`` like a self-attention module and is ``linear_attn``.

    >>> module_part("decoder.layers.3.self_attention.core_attention")
    ('attn_core', 3)
    >>> module_part("model.layers.0.mlp.gate")
    ('router', 0)
    >>> module_part("decoder.final_layernorm")
    ('norm', None)
    """
    m = _LAYER_PATH.match(path)
    if m:
        rest = m.group(2) or ""
        for pattern, part in _LAYER_RULES:
            if pattern.search(rest):
                if part == "attn_other" and type(module).__name__ == "GatedDeltaNet":
                    part = "linear_attn"
                return part, int(m.group(1))
        return None
    if ".layers." in f".{path}.":
        return None
    for pattern, part in _TOP_RULES:
        if pattern.search(path):
            return part, None
    return None


# id(module) -> (weak reference, part, global layer); filled by register_model.
_REGISTRY: dict[int, tuple[weakref.ref, str, Optional[int]]] = {}
_OPEN: dict[int, list] = {}  # id(module) -> stack of open record_function ranges
_RECORDING = [False]  # inside recording(): part_range opens its range


def register_model(model: torch.nn.Module) -> int:
    """Register the parts of ``model`` (megatron-core ``GPTModel`` or a Hugging Face causal LM) for
    :func:`recording`. Returns how many modules were registered (0: no known part; nothing is traced).

    The global layer index is ``layer.layer_number - 1`` where the decoder layer module has a
    ``layer_number`` (megatron-core, 1-based with the pipeline offset), else the path's index.
    """
    layer_offset: dict[str, int] = {}
    n = 0
    for path, mod in model.named_modules():
        m = _LAYER_PATH.match(path)
        if m and not m.group(2) and isinstance(getattr(mod, "layer_number", None), int):
            layer_offset[path] = mod.layer_number - 1
        found = module_part(path, mod)
        if found is None:
            continue
        part, layer = found
        if layer is not None:
            layer = layer_offset.get(path[: m.end(1)], layer)
        _REGISTRY[id(mod)] = (weakref.ref(mod), part, layer)
        n += 1
    return n


def registered_modules() -> list[tuple[str, Optional[int]]]:
    """``(part, layer)`` of every live registered module (for tests and logs)."""
    return [(part, layer) for ref, part, layer in _REGISTRY.values() if ref() is not None]


def _entry(module):
    e = _REGISTRY.get(id(module))
    return e if e is not None and e[0]() is module else None


# The hooks run eagerly, never traced by dynamo: a hook that fires inside a compiled function's eager part (after a
# graph break; megatron-core's GatedDeltaNet calls out_norm inside a torch.compile'd method) was compiled as a new
# frame, once per layer, inside the profiled step.
@torch.compiler.disable
def _pre_hook(module, args):
    e = _entry(module)
    if e is not None:
        rf = torch.profiler.record_function(region_name(e[1], e[2], torch._C._current_graph_task_id() != -1))
        rf.__enter__()
        _OPEN.setdefault(id(module), []).append(rf)


@torch.compiler.disable
def _post_hook(module, args, output):
    stack = _OPEN.get(id(module))
    if stack:
        stack.pop().__exit__(None, None, None)


@contextlib.contextmanager
def recording(enabled: bool = True) -> Iterator[None]:
    """Install the global module hooks for the duration of the block (a recorded profiler step).

    The post-hook is registered with ``always_call=True``, so a forward that raises still closes its
    range. Ranges left open at the end of the block (a forward interrupted by an exception that
    bypassed the hook) are closed in reverse order.
    """
    if not enabled or not _REGISTRY:
        yield
        return
    pre = torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook)
    post = torch.nn.modules.module.register_module_forward_hook(_post_hook, always_call=True)
    _RECORDING[0] = True
    try:
        yield
    finally:
        _RECORDING[0] = False
        pre.remove()
        post.remove()
        for stack in _OPEN.values():
            while stack:
                stack.pop().__exit__(None, None, None)
        _OPEN.clear()


@contextlib.contextmanager
def part_range(part: str) -> Iterator[None]:
    """The model-part range of ``part`` (outside the decoder layers) around work that runs outside every registered
    module's forward, e.g. the megatron engine's loss on the logits path, which follows ``output_layer``. Only while
    :func:`recording` is active (otherwise nothing); a recompute range inside a backward, as for modules.

    Raises:
        ValueError: ``part`` is not one of :data:`PARTS`.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if not _RECORDING[0]:
        yield
        return
    with torch.profiler.record_function(region_name(part, None, torch._C._current_graph_task_id() != -1)):
        yield
