"""The one compatibility patch this project applies to megatron-core 0.16.1 (used without Transformer Engine).

megatron-core 0.16.1, ``megatron/core/transformer/moe/moe_utils.py``, imports ``te_general_gemm`` from
Transformer Engine inside a ``try`` block and, when TE is missing, never binds the name. The MoE
router's fp32/fp64 gating GEMM (``RouterGatingLinearFunction``) then tests ``te_general_gemm is not None``
and fails with ``NameError: name 'te_general_gemm' is not defined``. Binding the name to ``None``
selects the plain ``torch`` GEMM path that the same function already contains. Nothing else changes.

:func:`apply_megatron_compat` is idempotent and leaves a working TE import untouched.
"""
from __future__ import annotations


def apply_megatron_compat() -> bool:
    """Bind ``moe_utils.te_general_gemm = None`` when megatron-core left it undefined (no TE).

    Returns:
        True when the patch was applied now, False when the name already existed (TE present, or
        already patched).
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    # megatron-core 0.16.1 without Transformer Engine: see the module docstring.
    moe_utils.te_general_gemm = None
    return True
