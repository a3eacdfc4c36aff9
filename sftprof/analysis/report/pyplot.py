"""matplotlib's pyplot for the summary's PNGs, on the Agg backend (files only: no display is needed or used)."""
from __future__ import annotations

from typing import Any


def pyplot() -> Any:  # the module matplotlib.pyplot (its types are not followed: pyproject.toml)
    """``matplotlib.pyplot`` with the Agg backend chosen before pyplot loads. Imported on the first call, not at
    import (0.4-0.6 s on this project's 2-core CPU machine): a process that writes no plot never pays for it, and
    ``postprocess_profile.py --after-trial`` calls this while its trial trains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
