"""What a simulated rank's collectives hand back: every output and receive buffer filled, as if each peer held this
rank's data (docs/simulated_rank.md, "What runs, what does not").

torch's fake process group runs no collective; depending on the torch version it leaves receives, all-to-all and
reduce-scatter outputs as allocated (``torch.empty``: garbage, NaN or Inf in a real run). :func:`install` wraps the
methods of ``ProcessGroup`` that ``torch.distributed`` calls so that, on a fake group only (a gloo or NCCL group is
untouched), after the fake op:

- a receive holds a copy of the tensor of its shape and dtype this rank sends beside it (the send before it not yet
  received, else the next send), zeros when this rank sends none;
- an all-to-all's slot from each peer repeats this rank's own slot (what it sends itself; its whole input when that
  slot is empty), cut or repeated to the slot's rows; zeros when its input is empty;
- a reduce-scatter's output is this rank's slice of its input, not summed.

All-gathers (N copies of the input) and all-reduces (the input, unreduced) are torch's own. Sizes are never changed.
On CUDA the fill runs on the calling stream; a wrapped op's work makes the waiting stream wait for it, as NCCL's does.
"""
from __future__ import annotations

import weakref

import torch
from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup

_unreceived: dict[tuple, weakref.ref] = {}  # (shape, dtype, device) -> the last send no receive has taken
_unfilled: dict[tuple, weakref.ref] = {}  # (shape, dtype, device) -> the last receive no send has filled
_filled_event: dict[torch.device, torch.cuda.Event] = {}


class _FilledWork:
    """A fake op's work whose ``wait()`` also orders the waiting CUDA stream after the fills made so far."""

    def __init__(self, work, device: torch.device):
        self._work, self._device = work, device

    def wait(self, *args, **kwargs):
        torch.cuda.current_stream(self._device).wait_event(_filled_event[self._device])
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _key(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


def _done(work, tensors):
    """Record the fills on CUDA and wrap the work; CPU work is returned as it is."""
    device = tensors[0].device
    if device.type != "cuda":
        return work
    event = _filled_event.get(device)
    if event is None:
        event = _filled_event[device] = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return _FilledWork(work, device)


def fill_rows(out: torch.Tensor, src: torch.Tensor) -> None:
    """Fill ``out`` (rows along dim 0) with ``src``'s rows from its first, repeated or cut to ``out``'s rows;
    zeros when ``src`` has no rows. Trailing dimensions must hold as many elements."""
    if src.shape[0] == 0:
        out.zero_()
        return
    src = src.reshape(src.shape[0], *out.shape[1:])
    for start in range(0, out.shape[0], src.shape[0]):
        n = min(src.shape[0], out.shape[0] - start)
        out[start:start + n].copy_(src[:n])


def _split_sizes(splits) -> list[int]:
    """An all-to-all's split sizes as ints: None, a list, a tensor or a numpy array (megatron-core 0.19 passes
    numpy arrays); [] for equal slots."""
    return [] if splits is None else [int(s) for s in splits]


def _own_rows(inp: torch.Tensor, splits: list[int], rank: int, size: int) -> torch.Tensor:
    """This rank's slot of an all-to-all input: ``splits[rank]`` rows after the earlier slots (equal slots without
    ``splits``)."""
    if not splits:
        return inp.chunk(size)[rank]
    return inp.narrow(0, sum(splits[:rank]), splits[rank])


def _fill_all_to_all(pg, out, inp, out_splits, in_splits):
    out_splits, in_splits = _split_sizes(out_splits), _split_sizes(in_splits)
    own, size = _own_rows(inp, in_splits, pg.rank(), pg.size()), pg.size()
    src = own if own.shape[0] else inp
    for slot in (out.split(out_splits) if out_splits else out.chunk(size)):
        fill_rows(slot, src)


def _own_slice(inp: torch.Tensor, out: torch.Tensor, rank: int) -> torch.Tensor:
    n = out.numel()
    return inp.reshape(-1).narrow(0, rank * n, n).view(out.shape)


def _copy_unless_same(out: torch.Tensor, src: torch.Tensor) -> None:
    if out.data_ptr() != src.data_ptr():  # megatron's in-place reduce-scatter: the slice is already there
        out.copy_(src)


def _take(table: dict[tuple, weakref.ref], t: torch.Tensor) -> torch.Tensor | None:
    """The live tensor ``table`` holds for ``t``'s shape, dtype and device (removed from it), or None."""
    ref = table.pop(_key(t), None)
    return ref() if ref is not None else None


def _on_send(t: torch.Tensor) -> None:
    recv = _take(_unfilled, t)
    if recv is not None:
        recv.copy_(t)
    else:
        _unreceived[_key(t)] = weakref.ref(t)


def _on_recv(t: torch.Tensor) -> None:
    sent = _take(_unreceived, t)
    if sent is not None:
        t.copy_(sent)
    else:
        t.zero_()
        _unfilled[_key(t)] = weakref.ref(t)


def _send(orig, pg, tensors, *args):
    work = orig(pg, tensors, *args)
    for t in tensors:
        _on_send(t)
    return _done(work, tensors)


def _recv(orig, pg, tensors, *args):
    work = orig(pg, tensors, *args)
    for t in tensors:
        _on_recv(t)
    return _done(work, tensors)


def _all_to_all_single(orig, pg, out, inp, out_splits, in_splits, *args):
    work = orig(pg, out, inp, out_splits, in_splits, *args)
    _fill_all_to_all(pg, out, inp, out_splits, in_splits)
    return _done(work, [out])


def _all_to_all(orig, pg, outs, ins, *args):
    work = orig(pg, outs, ins, *args)
    for out in outs:
        fill_rows(out, ins[pg.rank()])
    return _done(work, outs)


def _reduce_scatter_single(orig, pg, out, inp, *args):
    work = orig(pg, out, inp, *args)
    _copy_unless_same(out, _own_slice(inp, out, pg.rank()))
    return _done(work, [out])


def _reduce_scatter_coalesced(orig, pg, outs, ins, *args):
    work = orig(pg, outs, ins, *args)
    for out, inp in zip(outs, ins):
        _copy_unless_same(out, _own_slice(inp, out, pg.rank()))
    return _done(work, outs)


def _reduce_scatter(orig, pg, outs, in_lists, *args):
    work = orig(pg, outs, in_lists, *args)
    for out, inputs in zip(outs, in_lists):
        _copy_unless_same(out, inputs[pg.rank()])
    return _done(work, outs)


# ProcessGroup method -> its fill; torch 2.13 renamed some (all_to_all_single, reduce_scatter_single*), older
# versions have the others: whichever exist are wrapped.
_FILLS = {
    "send": _send, "recv": _recv, "recv_anysource": _recv,
    "alltoall_base": _all_to_all_single, "all_to_all_single": _all_to_all_single, "alltoall": _all_to_all,
    "_reduce_scatter_base": _reduce_scatter_single, "reduce_scatter_single": _reduce_scatter_single,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
    "reduce_scatter_single_coalesced": _reduce_scatter_coalesced,
    "reduce_scatter": _reduce_scatter,
}


def _wrap(orig, fill):
    def method(pg, first, *args):
        tensors = first if isinstance(first, (list, tuple)) else [first]
        if not tensors or not isinstance(pg._get_backend(tensors[0].device), FakeProcessGroup):
            return orig(pg, first, *args)
        with torch.no_grad():  # a real backend writes outputs below autograd too
            return fill(orig, pg, first, *args)
    method.__wrapped__ = orig
    return method


def install() -> None:
    """Wrap ``ProcessGroup``'s receive, all-to-all and reduce-scatter methods (once per process): on a fake group
    their outputs are filled as the module says; other backends call the original alone."""
    for name, fill in _FILLS.items():
        orig = getattr(ProcessGroup, name, None)
        if orig is not None and not hasattr(orig, "__wrapped__"):
            setattr(ProcessGroup, name, _wrap(orig, fill))
