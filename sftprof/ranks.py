"""Which ranks to profile: rank-spec parsing and resolution against a layout.

Spec grammar (``PROFILE_RANKS``, ``perf_tracer.ranks``, ``memory_profiler.ranks``):

- ``pp_rank0`` (aliases ``pp-rank0``, ``pprank0``, ``default``): rank 0 of every pipeline stage;
- ``""`` (empty): every rank;
- ``0,2-4``: explicit ranks and inclusive ranges, resolved to ``[0, 2, 3, 4]``.
"""
from __future__ import annotations

import re

from sftprof.allocation import Layout

PP_RANK0_ALIASES = ("pp_rank0", "pp-rank0", "pprank0", "default")
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits (\d takes Arabic-Indic ones too)


class RankSpecError(ValueError):
    """A rank spec is malformed or names ranks outside the world size."""


def _explicit(spec: str) -> list[int]:
    ranks: set[int] = set()
    for item in spec.split(","):
        item = item.strip()
        m = _ITEM.fullmatch(item)
        if not m:
            raise RankSpecError(
                f"{item!r} is not a rank or range; accepted: {'|'.join(PP_RANK0_ALIASES)}, empty (all ranks), "
                "or a comma list of ranks and ranges such as 0,2-4")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise RankSpecError(f"range {item!r} is reversed; write {hi}-{lo}")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


def format_ranks(ranks: list[int]) -> str:
    """Compact text of sorted ranks, e.g. ``[0, 2, 3, 4]`` -> ``"0,2-4"`` (inverse of the spec grammar)."""
    parts: list[str] = []
    for r in ranks:
        if parts and r == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def check_rank_spec_syntax(spec: str) -> None:
    """Raise :class:`RankSpecError` if ``spec`` is not a valid rank spec (world size not checked)."""
    spec = spec.strip()
    if spec and spec not in PP_RANK0_ALIASES:
        _explicit(spec)


def resolve_ranks(spec: str | None, layout: Layout) -> list[int]:
    """Resolve a rank spec to sorted global ranks; ``None`` means the default ``pp_rank0``.

    Returns:
        Sorted list of ranks; an empty spec returns every rank ``[0, world_size)``.

    Raises:
        RankSpecError: malformed spec, reversed range, or a rank >= ``layout.world_size``.
    """
    spec = "pp_rank0" if spec is None else spec.strip()
    if spec in PP_RANK0_ALIASES:
        return layout.pp_stage_first_ranks()
    if not spec:
        return list(range(layout.world_size))
    ranks = _explicit(spec)
    bad = [r for r in ranks if r >= layout.world_size]
    if bad:
        raise RankSpecError(f"ranks {format_ranks(bad)} are outside the world size {layout.world_size} (valid: 0-{layout.world_size - 1})")
    return ranks
