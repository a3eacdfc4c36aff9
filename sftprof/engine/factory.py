"""``build_engine``: the engine of an allocation mode's backend (kept apart from the interface in
:mod:`sftprof.engine.base`, which the backends import, so that no import runs in a cycle)."""
from __future__ import annotations

import torch

from sftprof.engine.base import Engine


def build_engine(cfg, layout, hf_config, device: torch.device) -> Engine:
    """Build the engine of ``layout.backend`` (``fsdp`` or ``megatron``; each imported only when used: the megatron
    engine imports megatron-core, optional and loaded only after :func:`sftprof.compat.setup_transformer_engine`).

    Args:
        cfg: the trial's :class:`sftprof.config.SFTProfileConfig`.
        layout: :class:`sftprof.allocation.Layout` parsed from ``actor.backend``.
        hf_config: the Hugging Face (text) config from :func:`sftprof.models.hf.load_hf_config`.
        device: this rank's device (``cuda:<local_rank>`` or ``cpu``).

    Raises:
        ValueError: unknown backend.
    """
    if layout.backend == "fsdp":
        from sftprof.engine.fsdp import FSDPEngine
        return FSDPEngine(cfg, layout, hf_config, device)
    if layout.backend == "megatron":
        from sftprof.engine.megatron import MegatronEngine
        return MegatronEngine(cfg, layout, hf_config, device)
    raise ValueError(f"actor.backend={cfg.actor.backend!r}: unknown backend {layout.backend!r}; accepted fsdp, megatron")
