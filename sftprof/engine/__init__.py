"""Training engines: ``fsdp`` (HF transformers + FSDP2) and ``megatron`` (megatron-core).

:mod:`sftprof.engine.base` is the interface; :func:`build_engine` (:mod:`sftprof.engine.factory`) picks
the backend of the allocation mode (each backend is imported only when used).
"""
from sftprof.engine.base import Engine, StepResult
from sftprof.engine.factory import build_engine

__all__ = ["Engine", "StepResult", "build_engine"]
