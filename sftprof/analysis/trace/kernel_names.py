"""Rules on names: category of a GPU kernel or CPU op, readable kernel name, a collective's name, the parallelism
label of a process group.

Pure string rules, no trace state; the kernel summary (:mod:`sftprof.analysis.time.trace_summary`), the model parts
(traces without model-part ranges, CPU runs) and the run comparison (:mod:`sftprof.analysis.compare.runs`) use them.
"""
from __future__ import annotations

import re

__all__ = ["kernel_category", "short_kernel_name", "collective_group_label", "cpu_op_category", "collective_name",
           "COMM_PREFIX", "HOST_COLLECTIVE_PREFIXES"]

COMM_PREFIX = "NCCL "  # category prefix of NCCL kernels: "NCCL <collective>"
HOST_COLLECTIVE_PREFIXES = ("gloo:", "nccl:")  # host-side collective ops (annotations or cpu_ops)
_SDPA_OP = re.compile(r"scaled_?dot_?product", re.IGNORECASE)  # aten::scaled_dot_product_*, ScaledDotProduct*Backward0

# Ordered (category, pattern) rules on the lower-cased kernel name; first match wins.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn|softmax_warp_forward_causal|mha_")),
    ("MoE routing/permutation", re.compile(
        r"moe|permut|topk|top_k|sort|radix|scatter|gather|index|histogram|histc|bincount|cumsum|"
        r"router|token_dispatch|masked_select|masked_scatter|nonzero|cub::|write_indices|row_id_map")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach|optimizer|lamb_|sgd_|l2norm")),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|_mm_|wgmma|splitk|hgemm|sgemm|dot_kernel")),
    ("elementwise/reduction", re.compile(
        r"elementwise|reduce|copy|fill|cat|norm|softmax|triton|unary|binary|functor|pow|mul|add|"
        r"silu|gelu|exp|log|where|clamp|sum|mean|max|min|cross_entropy|rms|rope")),
)
_NCCL = re.compile(r"nccl(?:dev)?kernel_([a-z]+)", re.IGNORECASE)
_NAMESPACES = re.compile(r"\(anonymous namespace\)::|\b(?:at::native|at::cuda|at|c10|std|cuda::std)::")

# megatron-core / torch process-group descriptions -> parallelism label.
_PG_LABELS = {
    "TENSOR_MODEL_PARALLEL_GROUP": "TP",
    "CONTEXT_PARALLEL_GROUP": "CP",
    "PIPELINE_MODEL_PARALLEL_GROUP": "PP",
    "DATA_PARALLEL_GROUP": "DP",
    "DATA_PARALLEL_GROUP_WITH_CP": "DP-CP",
    "EXPERT_MODEL_PARALLEL_GROUP": "EP",
    "EXPERT_TENSOR_PARALLEL_GROUP": "ETP",
    "EXPERT_DATA_PARALLEL_GROUP": "EDP",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "TP-DP",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "TP-DP-CP",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "TP-CP",
    "TENSOR_AND_EXPERT_PARALLEL_GROUP": "TP-EP",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "ETP-EP",
    "EMBEDDING_GROUP": "EMB",
    "POSITION_EMBEDDING_GROUP": "POS-EMB",
    "MODEL_PARALLEL_GROUP": "MP",
    "default_pg": "WORLD",
}


def kernel_category(name: str, cat: str = "kernel") -> str:
    """Category of one GPU activity from its trace category and kernel name.

    Args:
        name: kernel name as recorded by CUPTI (e.g. ``nvjet_sm90_tst_256x128_...``).
        cat: trace category, one of ``kernel``, ``gpu_memcpy``, ``gpu_memset``.

    Returns:
        ``memcpy/memset``, ``NCCL <Collective>`` for NCCL kernels (group added by the analyzer),
        or one of ``attention``, ``MoE routing/permutation``, ``optimizer``, ``GEMM``,
        ``elementwise/reduction``, ``other`` (name rules in ``_RULES``, first match wins).
    """
    if cat != "kernel":
        return "memcpy/memset"
    m = _NCCL.search(name)
    if m:
        return f"{COMM_PREFIX}{m.group(1)}"
    low = name.lower()
    for label, pattern in _RULES:
        if pattern.search(low):
            return label
    return "other"


def short_kernel_name(name: str, limit: int = 140) -> str:
    """Readable kernel name for tables: no ``void``, common namespaces or parameter list.

    ``void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...Functor<float, 1, 1, 0>,
    std::multiplies<float>, float>(...)`` becomes ``multi_tensor_apply_kernel<..., multiplies<float>,
    float>``; the template arguments are kept because they tell kernels apart. Cut to ``limit`` chars.
    """
    text = _NAMESPACES.sub("", name[5:] if name.startswith("void ") else name)
    depth = 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            text = text[:i]
            break
    return text if len(text) <= limit else text[: limit - 1] + "…"


def collective_group_label(pg_desc: str | None, pg_name: str | None) -> str | None:
    """Short parallelism label (TP, CP, EP, DP, ...) of a process group, or its description/name."""
    if pg_desc:
        return _PG_LABELS.get(pg_desc, pg_desc)
    return f"pg{pg_name}" if pg_name not in (None, "") else None


def collective_name(name: str) -> str:
    """A collective's name as torch records it, without the backend prefix and variant suffixes:
    ``nccl:all_gather_into_tensor_coalesced`` -> ``all_gather``."""
    return re.sub(r"(_into_tensor|_tensor)?(_coalesced|_base)?$", "", name.replace("nccl:", "").replace("gloo:", ""))


def cpu_op_category(name: str) -> str:
    """Category of one CPU op (traces without GPU activity): ``communication`` (host collectives, ``gloo:*`` /
    ``nccl:*``), ``attention`` (scaled-dot-product attention ops and their backward nodes), else ``cpu_op``."""
    if name.startswith(HOST_COLLECTIVE_PREFIXES):
        return "communication"
    return "attention" if _SDPA_OP.search(name) else "cpu_op"
