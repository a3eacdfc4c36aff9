"""Part of ``profile_summary.json``'s schema (:mod:`sftprof.analysis.schema`): the what-ifs (``what_if``,
``what_if_skipped``) and a what-if trial's ``tried_what_if``.

Declarations only, evaluated at run time (no postponed annotations: :func:`sftprof.analysis.schema.check` reads
``NotRequired`` from them); standard library only.
"""
from typing import Any, Literal, Optional, TypedDict


class WhatIfSetting(TypedDict):
    """One setting a what-if changes: a key of the trial's config (``config``: a ``key=value`` argument of the trial,
    ``value`` as the config holds it) or an environment variable of the trial's processes (``env``, ``value`` text).
    ``current`` is the trial's own value (None: unset, or not known from its files)."""
    kind: Literal["config", "env"]
    key: str
    value: Any
    current: Any


class WhatIfEffect(TypedDict):
    """A predicted change of one measured figure (:data:`sftprof.analysis.what_if.changes.METRICS`): ``value`` is B - A in
    ``unit`` (negative: less), ``baseline`` the trial's measured figure it changes (same unit)."""
    metric: str
    unit: str  # "ms" | "GiB" | "pct"
    value: float
    baseline: Optional[float]


class WhatIf(TypedDict):
    """A change to try (:mod:`sftprof.analysis.what_if.changes`): its settings, the predicted effect on ``rank`` (None: the
    trial as a whole), the assumption behind the prediction, and ``weight`` (the effect's share of its baseline) that
    orders the what-ifs the driver tries (``TRY_WHAT_IFS``). ``text``: the same in words."""
    key: str  # the lever, the same on every rank (sftprof.analysis.what_if.changes.LABELS)
    label: str
    text: str
    assumption: str
    rank: Optional[int]
    settings: list[WhatIfSetting]
    effect: WhatIfEffect
    weight: float


class WhatIfSkipped(TypedDict):
    """A what-if whose figure called for it but that is not proposed, and why (the trial already has the setting,
    Transformer Engine is absent, the backend has no such setting, ...)."""
    key: str
    label: str
    rank: Optional[int]
    reason: str


class TriedWhatIf(TypedDict):
    """What makes a trial a what-if trial (``RUN_DIR/what_if.json``, written by the driver): the trial it varies
    (same kind and step) and the what-if of that trial's summary it tries."""
    source_trial: str
    source_run_dir: str
    what_if: WhatIf
