"""Training engines: ``fsdp`` (HF transformers + FSDP2) and ``megatron`` (megatron-core).

See :mod:`sftprof.engine.base` for the interface; :func:`build_engine` picks the backend of the
allocation mode (the megatron engine is imported only when used).
"""
from sftprof.engine.base import Engine, StepResult, build_engine

__all__ = ["Engine", "StepResult", "build_engine"]
