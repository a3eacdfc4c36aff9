"""Compatibility with third-party code as this project uses it: megatron-core 0.16.1 to 0.19.x with and without
Transformer Engine; flash-linear-attention 0.6.0 on Hopper with the Triton that torch pins.

megatron-core versions (the one place where the project's code depends on which release is installed):
:func:`megatron_core_version` reads the release that ``import megatron.core`` finds (:mod:`sftprof.pycheck`, without
importing it); :func:`check_megatron_version` refuses one outside pyproject.toml's range (the driver's
pre-flight and :func:`sftprof.models.checks.check_model_settings`, before any GPU work);
:func:`megatron_at_least` answers for the first release of each difference below:

- :data:`PERMUTE_PADDING_OUTPUTS` (0.17.0): ``moe_utils.permute`` returns ``(tokens, probs, sorted_indices,
  pad_offsets, tokens_per_expert)`` (0.16: the first three) and ``unpermute`` takes ``pad_offsets``; its unfused
  path finds the tokens by an argsort, not ``masked_select``;
- :data:`TE_GENERAL_GEMM_BOUND` (0.17.0): ``moe_utils`` binds ``te_general_gemm = None`` without TE (patch 1 below
  is for earlier releases);
- :data:`GATED_DELTA_NET_CP` (0.18.0): ``GatedDeltaNet`` has context parallelism (an all-to-all from sequence to
  heads around the delta rule, on the load-balanced chunks of :func:`sftprof.data.cp_shard`); 0.16/0.17 refuse
  CP > 1 in ``TransformerConfig``;
- :data:`GATED_DELTA_NET_PACKAGE` (0.19.0): ``megatron.core.ssm.gated_delta_net`` is a package whose fla imports
  (``HAVE_FLA``, ``l2norm``) live in its ``common`` module (:func:`gated_delta_net_kernels`).

Differences that need no version test: from 0.17 megatron-core passes ``is_mtp_layer=`` and (0.18) ``name=`` to the
MoE layer, its experts and shared experts; this project's MoE layers pass unknown keywords on to ``MoELayer`` and its
experts accept ``name``. From 0.17 the router calls ``topk_routing_with_score_function`` with ``dense_output`` and
(0.19) ``precomputed_indices``, which :mod:`sftprof.models.layers.router` hands to megatron's own function.

Transformer Engine (TE) in a trial's process, :func:`setup_transformer_engine` (before anything imports megatron):

- ``actor.megatron.transformer_impl=local`` hides TE (``sys.modules`` entries of ``None``, which make every
  ``import transformer_engine`` raise ``ModuleNotFoundError`` and ``importlib.util.find_spec`` return ``None``),
  so megatron-core, TE present on the machine, builds the local specs and torch's Adam as on a machine without it.
- cuDNN: TE's loader (``transformer_engine/common/__init__.py``) loads ``libcudnn`` from ``CUDNN_HOME``,
  ``CUDNN_PATH``, ``CUDA_HOME`` or ``/usr/local/cuda`` before the Python packages, with ``RTLD_GLOBAL``. On a
  machine whose system cuDNN is older than the pip cuDNN torch was built against (seen on the H200: 9.14 against
  9.19) torch then finds the older one and ``torch.backends.cudnn.version()`` raises a version clash. Loading
  torch's cuDNN first and pointing ``CUDNN_HOME`` at its folder makes TE open the same file; a clash that remains
  is a start-up error naming both versions and the fix.

megatron-core without Transformer Engine (TE), :func:`apply_megatron_compat`:

1. (0.16 only) ``megatron/core/transformer/moe/moe_utils.py`` imports ``te_general_gemm`` from TE inside a ``try``
   block and, when TE is missing, never binds the name. The MoE router's fp32/fp64 gating GEMM
   (``RouterGatingLinearFunction``) then tests ``te_general_gemm is not None`` and fails with
   ``NameError: name 'te_general_gemm' is not defined``. Binding the name to ``None`` selects the plain
   ``torch`` GEMM path that the same function already contains.
2. (0.16 to 0.19) ``megatron/core/tensor_parallel/random.py``: ``CheckpointWithoutOutput.__init__(fp8=False)`` sets
   ``self.fp8 = fp8 is not None``, which is ``True`` for the default ``False``, so every output-discarding
   checkpoint (selective recompute of ``layernorm``, ``moe_act``, ...) calls TE's ``FP8GlobalStateManager``
   and fails with ``NameError`` when TE is missing. Without TE there is no FP8, so ``fp8`` is set to
   ``False`` after construction, which selects the plain-context branch the class already has.

flash-linear-attention 0.6.0 on Hopper, :func:`narrow_fla_hopper_guard`: fla's gated
``chunk_bwd_dqkwg`` (the backward of Qwen3.5's gated delta rule) raises on Hopper with Triton in
``[3.4.0, 3.7.1)`` (fla issue #640: a Triton code-generation fault that corrupts ``dk``). The bisection in
that issue found the fault at a key block width ``BK`` of 64 only (32 and 128 gave correct gradients); fla's
guard refuses every width. The function lifts the guard only for models whose key head dim gives
``BK != 64`` and refuses the others; ``tests/test_fla_gated_delta_gpu.py`` checks fla's gradients against a
token-by-token fp32 reference on the GPU at the head dims the project uses.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Tuple

from sftprof.config import ConfigError
from sftprof.pycheck import megatron_core_problem, megatron_core_version as _read_megatron_core_version

TE_MODULES = ("transformer_engine", "transformer_engine_torch")

# The first megatron-core release of each difference (module docstring).
PERMUTE_PADDING_OUTPUTS = (0, 17, 0)
TE_GENERAL_GEMM_BOUND = (0, 17, 0)
GATED_DELTA_NET_CP = (0, 18, 0)
GATED_DELTA_NET_PACKAGE = (0, 19, 0)


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> Tuple[int, int, int]:
    """``(major, minor, patch)`` of the megatron-core that ``import megatron.core`` finds (read once).

    Raises:
        ConfigError: megatron-core is not installed, or its version cannot be read.
    """
    try:
        version = _read_megatron_core_version()
    except ValueError as err:
        raise ConfigError(f"actor.backend=megatron: {err}") from err
    if version is None:
        raise ConfigError("actor.backend=megatron: megatron-core is not installed (pip install -e <the sftprof "
                          "repository>)")
    return version


def check_megatron_version() -> None:
    """Refuse a megatron-core outside the supported releases (pyproject.toml's range, ``sftprof.pycheck.megatron_core_problem``).

    Raises:
        ConfigError: naming the installed and the supported versions (or what could not be read).
    """
    megatron_core_version()  # missing or unreadable: its own error
    problem = megatron_core_problem()
    if problem:
        raise ConfigError(f"actor.backend=megatron: {problem}")


def megatron_at_least(release: Tuple[int, int, int]) -> bool:
    """Whether the installed megatron-core is ``release`` or later (one of this module's release constants)."""
    return megatron_core_version() >= release


def gated_delta_net_kernels() -> ModuleType:
    """The megatron-core module whose fla imports ``GatedDeltaNet`` uses (``HAVE_FLA``, ``l2norm``,
    ``chunk_gated_delta_rule``): ``megatron.core.ssm.gated_delta_net`` before 0.19, its ``common`` module since."""
    if megatron_at_least(GATED_DELTA_NET_PACKAGE):
        from megatron.core.ssm.gated_delta_net import common
        return common
    from megatron.core.ssm import gated_delta_net
    return gated_delta_net


def apply_megatron_compat() -> bool:
    """Apply the megatron-core patches of the module docstring that the installed release needs when Transformer
    Engine is missing.

    Idempotent; leaves a working TE import untouched.

    Returns:
        True when a patch was applied now, False when nothing was needed (TE present, or already patched).
    """
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    applied = False
    if not megatron_at_least(TE_GENERAL_GEMM_BOUND) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # item 1 of the module docstring
        applied = True
    cls = mrandom.CheckpointWithoutOutput
    if not mrandom.HAVE_TE and not getattr(cls, "_sftprof_no_fp8", False):
        init = cls.__init__

        def __init__(self, *args, **kwargs):  # item 2 of the module docstring
            init(self, *args, **kwargs)
            self.fp8 = False

        cls.__init__ = __init__
        cls._sftprof_no_fp8 = True
        applied = True
    return applied


def fla_key_block_width(key_head_dim: int, hopper_shared_mem: bool) -> int:
    """The key block width ``BK`` that fla 0.6.0's ``chunk_bwd_dqkwg`` picks for a key head dim.

    Mirrors ``fla/ops/common/chunk_o.py``: ``min(max(next_power_of_2(K), 16), T)`` with ``T = 128`` on GPUs
    with Hopper-sized shared memory, else 64 or less (64 is returned as the bound then).

    Args:
        key_head_dim: ``K``, the gated delta net's key head dim (Qwen3.5-35B-A3B: 128).
        hopper_shared_mem: fla's ``check_shared_mem('hopper')`` for the device.
    """
    pow2 = 1 << max(key_head_dim - 1, 0).bit_length()
    return min(max(pow2, 16), 128 if hopper_shared_mem else 64)


def narrow_fla_hopper_guard(key_head_dim: int) -> Optional[str]:
    """Lift fla's Hopper/Triton guard on the gated ``chunk_bwd_dqkwg`` when this model's ``BK`` is not 64.

    See the module docstring. Does nothing when fla is not importable or the guard does not apply (not
    Hopper, or Triton outside ``[3.4.0, 3.7.1)``).

    Args:
        key_head_dim: the model's ``linear_key_head_dim``.
    Returns:
        A message to log when the guard was lifted, else None.
    Raises:
        sftprof.config.ConfigError: the guard applies and ``BK`` is 64 (the width with the known fault):
            names ``actor.path`` and the fix (Triton >= 3.7.1).
    """
    try:
        import torch
        import triton
        from fla.ops.common import chunk_o
    except ImportError:
        return None
    if not (chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1):
        return None
    bk = fla_key_block_width(key_head_dim, chunk_o.check_shared_mem(
        "hopper", torch.cuda.current_device() if torch.cuda.is_available() else 0))
    if bk == 64:
        raise ConfigError(f"actor.path: linear_key_head_dim={key_head_dim} gives fla's gated chunk_bwd_dqkwg a key "
                          f"block of 64, the width at which Triton {triton.__version__} on Hopper computes wrong "
                          "gradients (fla issue #640); install triton>=3.7.1")
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return (f"fla gated delta rule: lifted fla's guard against Triton {triton.__version__} on Hopper (fla issue #640, "
            f"a fault at key block 64) because linear_key_head_dim={key_head_dim} uses key block {bk}; "
            "tests/test_fla_gated_delta_gpu.py checks these gradients against an fp32 reference")


def _loaded_library(stem: str) -> Optional[str]:
    """Path of the shared library ``<stem>.so*`` mapped into this process (``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


def build_with_te_wgrad_fusion(build):
    """``build()`` (a megatron-core model) with weight-gradient accumulation fused in TE's layers only.

    ``TransformerConfig.gradient_accumulation_fusion`` serves two kinds of layer: TE's linears fuse the accumulation
    into ``main_grad`` with TE's own GEMM, megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (the
    output layer of a TE model) need APEX's ``fused_weight_gradient_mlp_cuda`` and refuse to build without it.
    Without APEX the model is built with the refusal lifted and megatron-core's own linears are then switched to
    their unfused path, so TE's layers keep the fusion.
    """
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return build()
    layers._grad_accum_fusion_available = True
    try:
        model = build()
    finally:
        layers._grad_accum_fusion_available = False
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            module.gradient_accumulation_fusion = False
    return model


def setup_transformer_engine(mode: str) -> tuple[bool, list[str]]:
    """Apply ``actor.megatron.transformer_impl`` (module docstring) in this process; call before megatron imports.

    Args:
        mode: ``auto``, ``transformer_engine`` or ``local`` (:data:`sftprof.config.TRANSFORMER_IMPLS`).
    Returns:
        ``(have_te, notes)``: whether ``transformer_engine.pytorch`` imports now, and lines to log (the cuDNN
        library TE and torch use, the gradient-accumulation fusion kernel).
    Raises:
        ConfigError: ``mode=transformer_engine`` and TE does not import (names the import error); torch and TE load different
            cuDNN versions (names both and ``CUDNN_HOME``).
    """
    if mode == "local":
        for name in TE_MODULES:
            if sys.modules.get(name) is not None:
                raise ConfigError(f"actor.megatron.transformer_impl=local: {name} was imported before the trial "
                                  "could hide it")
            sys.modules[name] = None
        return False, ["transformer_engine: hidden (actor.megatron.transformer_impl=local): local specs, torch Adam"]
    if importlib.util.find_spec("transformer_engine") is None:
        if mode == "transformer_engine":
            raise ConfigError("actor.megatron.transformer_impl=transformer_engine: transformer_engine is not installed; accepted: "
                              "auto or local, or install transformer-engine[pytorch]")
        return False, []
    import torch

    notes = []
    if torch.cuda.is_available() and "transformer_engine" not in sys.modules:
        torch_cudnn = torch.backends.cudnn.version()  # loads torch's libcudnn before TE's loader runs
        lib = _loaded_library("libcudnn")
        if lib:
            # TE's core library needs cuDNN's sub-libraries too: load torch's, so none comes from the system. Also
            # when CUDNN_HOME is inherited (a trial started by a process that ran this), where TE's loader still
            # opens the system's sub-libraries (libcudnn_heuristic: undefined symbol of libcudnn_graph)
            for sub in sorted(glob.glob(os.path.join(os.path.dirname(lib), "libcudnn*.so*"))):
                ctypes.CDLL(sub, mode=ctypes.RTLD_GLOBAL)
        if lib and not (os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")):
            os.environ["CUDNN_HOME"] = os.path.dirname(lib)
            notes.append(f"cuDNN: CUDNN_HOME={os.path.dirname(lib)} (torch's cuDNN {torch_cudnn}), so that "
                         "Transformer Engine loads the same library")
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch as tex
    except Exception as err:  # a broken TE install behaves as no TE, unless TE is required
        if mode == "transformer_engine":
            raise ConfigError(f"actor.megatron.transformer_impl=transformer_engine: transformer_engine does not import: "
                              f"{type(err).__name__}: {err}") from err
        return False, [f"transformer_engine does not import ({type(err).__name__}: {err}): local specs"]
    if torch.cuda.is_available():
        te_cudnn = tex.get_cudnn_version()
        try:
            torch_cudnn = torch.backends.cudnn.version()
        except RuntimeError as err:
            torch_cudnn = f"error ({' '.join(str(err).split())})"
        if te_cudnn != torch_cudnn:
            raise ConfigError(f"cuDNN: Transformer Engine loaded cuDNN {te_cudnn}, torch {torch_cudnn} "
                              f"(libcudnn {_loaded_library('libcudnn')}); set CUDNN_HOME to the folder of the "
                              "libcudnn.so.* that torch was built against (its nvidia/cudnn/lib), or install a "
                              "matching system cuDNN")
        notes.append(f"transformer_engine {transformer_engine.__version__}, cuDNN {te_cudnn} (same library as torch)")
    fusion = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    notes.append("gradient-accumulation fusion: TE layers fuse weight-gradient accumulation into main_grad; "
                 + ("megatron-core's own linears too (APEX's fused_weight_gradient_mlp_cuda)" if fusion else
                    "megatron-core's own linears (the output layer) do not: APEX's fused_weight_gradient_mlp_cuda "
                    "is not installed"))
    return True, notes
