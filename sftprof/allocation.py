"""Allocation modes: backend + parallel layout, and Megatron's rank -> coordinate map.

Grammar (one letter per parallel dimension followed by its size; an omitted dimension is 1)::

    fsdp:d2                             data parallel only (FSDP2)
    megatron:d2t2p2                     one layout for attention and experts (ep=1, etp=tp)
    megatron:(attn:d2c4|ffn:d1e8)       attention layout | expert (MoE FFN) layout

Attention letters: ``d`` data (DP), ``t`` tensor (TP), ``p`` pipeline (PP), ``c`` context (CP).
Expert letters: ``d`` expert data (EDP), ``e`` expert (EP), ``t`` expert tensor (ETP), ``p``
pipeline (must equal the attention PP). Both layouts must cover the same world size:
``dp*cp*tp*pp == edp*ep*etp*pp``.

Rank order follows megatron-core's default ``order="tp-cp-ep-dp-pp"`` (the first name varies
fastest; ``megatron/core/parallel_state.py``, ``RankGenerator``): for attention
``rank = tp + TP*(cp + CP*(dp + DP*pp))`` and for experts ``rank = etp + ETP*(ep + EP*(edp + EDP*pp))``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

BACKENDS = ("megatron", "fsdp")


class AllocationError(ValueError):
    """An allocation-mode string cannot be parsed or its layouts disagree."""


@dataclass(frozen=True)
class Layout:
    """Parsed allocation mode. All sizes are >= 1; ``world_size`` is the number of ranks."""

    backend: str
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    edp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp * cp * tp * pp`` (equal to ``edp * ep * etp * pp``)."""
        return self.dp * self.cp * self.tp * self.pp

    def rank_coords(self, rank: int) -> dict:
        """Return ``{"pp", "dp", "cp", "tp", "ep", "etp"}`` of global ``rank`` (Megatron order).

        Raises:
            AllocationError: ``rank`` is outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise AllocationError(f"rank {rank} outside [0, {self.world_size})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        etp = rank % self.etp
        ep = (rank // self.etp) % self.ep
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "etp": etp}

    def pp_stage_first_ranks(self) -> list[int]:
        """Global rank 0 of each pipeline stage, e.g. ``[0, 4]`` for ``megatron:d2t2p2``."""
        stage = self.world_size // self.pp
        return [s * stage for s in range(self.pp)]

    def describe(self) -> str:
        """Human-readable layout, e.g. ``dp=2 cp=4 tp=1 pp=1 | edp=1 ep=8 etp=1 (world 8)``."""
        return (f"dp={self.dp} cp={self.cp} tp={self.tp} pp={self.pp} | "
                f"edp={self.edp} ep={self.ep} etp={self.etp} (world {self.world_size})")


_DIM = re.compile(r"([a-z])(\d+)")


# appended to a bad one-layout megatron spec's error: the experts' letters need the two-layout form
_EXPERT_FORM = ("; expert parallelism takes the form megatron:(attn:LAYOUT|ffn:LAYOUT) with ffn letters ['d', 't', "
                "'p', 'e'] (EDP, ETP, PP, EP), e.g. megatron:(attn:d2c4|ffn:d1e8)")


def _parse_dims(text: str, letters: str, where: str, example: str = "d2t2", hint: str = "") -> dict:
    """``{letter: size}`` of a layout spec such as ``d2t2``; ``hint`` ends each syntax error (AllocationError)."""
    if not text or not re.fullmatch(r"(?:[a-z]\d+)+", text):
        raise AllocationError(f"{where} {text!r}: expected letter+size pairs such as {example} using letters "
                              f"{list(letters)}{hint}")
    dims: dict = {}
    for letter, size in _DIM.findall(text):
        if letter not in letters:
            raise AllocationError(f"{where} {text!r}: unknown dimension {letter!r}; accepted letters "
                                  f"{list(letters)}{hint}")
        if letter in dims:
            raise AllocationError(f"{where} {text!r}: dimension {letter!r} given twice")
        if int(size) < 1:
            raise AllocationError(f"{where} {text!r}: size of {letter!r} must be >= 1")
        dims[letter] = int(size)
    return dims


def parse_allocation_mode(mode: str) -> Layout:
    """Parse an allocation mode such as ``megatron:(attn:d2c4|ffn:d1e8)`` into a :class:`Layout`.

    Raises:
        AllocationError: unknown backend, bad syntax, a dimension the backend cannot use, or
            attention and expert layouts with different world sizes or PP sizes.
    """
    if not isinstance(mode, str) or ":" not in mode:
        raise AllocationError(f"{mode!r}: expected BACKEND:LAYOUT with BACKEND in {list(BACKENDS)}, e.g. fsdp:d2 or megatron:(attn:d2c4|ffn:d1e8)")
    backend, spec = mode.split(":", 1)
    backend, spec = backend.strip(), spec.replace(" ", "")
    if backend not in BACKENDS:
        raise AllocationError(f"{mode!r}: unknown backend {backend!r}; accepted {list(BACKENDS)}")
    if backend == "fsdp":
        dims = _parse_dims(spec, "d", "fsdp layout")
        return Layout(backend="fsdp", dp=dims.get("d", 1), edp=dims.get("d", 1))
    hybrid = re.fullmatch(r"\(attn:([a-z0-9]+)\|ffn:([a-z0-9]+)\)", spec)
    if hybrid:
        attn = _parse_dims(hybrid.group(1), "dtpc", "attention layout")
        ffn = _parse_dims(hybrid.group(2), "dtpe", "expert layout", example="d1e8")
    elif spec.startswith("("):
        raise AllocationError(f"{mode!r}: expected megatron:(attn:LAYOUT|ffn:LAYOUT), e.g. megatron:(attn:d2c4|ffn:d1e8)")
    else:
        attn = _parse_dims(spec, "dtpc", "megatron layout", hint=_EXPERT_FORM)
        ffn = None
    dp, tp, pp, cp = (attn.get(k, 1) for k in "dtpc")
    if ffn is None:
        ep, etp = 1, tp
        edp = dp * cp
    else:
        edp, ep, etp = ffn.get("d", 1), ffn.get("e", 1), ffn.get("t", 1)
        if ffn.get("p", pp) != pp:
            raise AllocationError(f"{mode!r}: expert pipeline size p{ffn['p']} differs from attention p{pp}")
    layout = Layout("megatron", dp=dp, cp=cp, tp=tp, pp=pp, edp=edp, ep=ep, etp=etp)
    expert_world = edp * ep * etp * pp
    if expert_world != layout.world_size:
        raise AllocationError(
            f"{mode!r}: attention world size dp*cp*tp*pp={layout.world_size} differs from expert world size "
            f"edp*ep*etp*pp={expert_world}")
    return layout
