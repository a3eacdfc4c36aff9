"""The model's layers and fused ops apart from model construction and weight loading.

Megatron-core modules of the local (no Transformer Engine) spec, picked by :mod:`sftprof.models.specs`:
:mod:`attention` (SDPA core attention with context parallelism) and :mod:`block_attention` (its blockwise CP
kernels), :mod:`experts` (grouped-GEMM experts), :mod:`norm` (RMSNorm), :mod:`router` (fused top-k routing),
:mod:`moe_permute` and :mod:`moe_dedup` (MoE token dispatch), :mod:`rope` and :mod:`swiglu` (fused elementwise ops);
:mod:`op_inputs` checks these ops' inputs. Each op's Triton kernels sit beside it in ``<op>_kernels.py``, imported
only where Triton runs (CUDA, or its CPU interpreter in tests). Both backends: :mod:`routing` (the routers' load per
step) and :mod:`bshd` (padded batches repacked to the packed token order).
"""
