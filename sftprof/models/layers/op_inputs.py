"""Input checks shared by the model's fused ops (:mod:`sftprof.models.layers.swiglu`, :mod:`sftprof.models.layers.rope`,
:mod:`sftprof.models.layers.moe_permute`, :mod:`sftprof.models.layers.norm`): a wrong type, dtype or device is a ``ValueError``
naming the op, the argument, what it got and what is accepted, raised on the host before any kernel runs (a Triton
kernel handed a CPU pointer or an integer tensor would fault or compute garbage)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["FLOAT_DTYPES", "check_tensor"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the Triton kernels load and store


def check_tensor(op: str, name: str, t, dtypes: Sequence[torch.dtype], device: Optional[torch.device] = None,
                 cpu_dtypes: Sequence[torch.dtype] = ()) -> None:
    """Check that ``t`` is a ``torch.Tensor`` of one of ``dtypes`` (or of ``cpu_dtypes`` when on the CPU) on ``device``.

    Args:
        op: the op's name, first in the message (``"swiglu_with_probs"``).
        name: the argument's name (``"probs"``).
        t: the value passed.
        dtypes: accepted dtypes on every device.
        device: the device ``t`` must be on (that of the op's first tensor); None: any.
        cpu_dtypes: further dtypes accepted on the CPU only (fp64 for the torch paths' references).
    Raises:
        ValueError: ``"swiglu_with_probs: probs must be a torch.Tensor of torch.float32 or torch.bfloat16 on cuda:0,
            got torch.int64 on cuda:0"``.
    """
    on_cpu = isinstance(t, torch.Tensor) and t.device.type == "cpu"
    ok = (isinstance(t, torch.Tensor) and (t.dtype in dtypes or on_cpu and t.dtype in cpu_dtypes)
          and (device is None or t.device == device))
    if not ok:
        accepted = " or ".join(str(d) for d in dtypes) + (
            f" (also {' or '.join(str(d) for d in cpu_dtypes)} on cpu)" if cpu_dtypes else "")
        where = f" on {device}" if device is not None else ""
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be a torch.Tensor of {accepted}{where}, got {got}")
