"""The software a trial runs with, as ``LOG_DIR/versions.json`` records it (:data:`sftprof.artifacts.VERSIONS`):
sftprof's own version and commit, Python, torch and its CUDA and NCCL, megatron-core, TE, transformers, Triton and
flash-linear-attention (:func:`recorded_versions`)."""
from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional

try:
    import tomllib  # Python 3.11+: a source checkout's version (sftprof_version)
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

from sftprof.pycheck import megatron_core_version

__all__ = ["RECORDED_DISTRIBUTIONS", "recorded_versions", "sftprof_version"]

# The software a trial runs with (VERSIONS): key -> the distribution whose installed version is recorded.
RECORDED_DISTRIBUTIONS = {"torch": "torch", "megatron_core": "megatron-core",
                          "transformer_engine": "transformer-engine", "transformers": "transformers", "triton": "triton",
                          "flash_linear_attention": "flash-linear-attention"}


def recorded_versions(torch_cuda: Optional[str], nccl: Optional[str]) -> dict[str, Optional[str]]:
    """The versions a trial runs with: ``sftprof`` (:func:`sftprof_version`), ``python``
    (``platform.python_version()``), ``torch_cuda`` and ``nccl`` (the running torch's ``torch.version.cuda`` and NCCL
    version, given: None for a CPU build) and each of :data:`RECORDED_DISTRIBUTIONS` as installed
    (``importlib.metadata``: nothing is imported), None when it is not installed; megatron-core's is that of the
    package ``import megatron.core`` finds (its ``package_info.py``: a checkout on ``PYTHONPATH`` too).

    Raises:
        ValueError: megatron-core's ``package_info.py`` cannot be read (names the file).
    """
    dists = {key: _installed(name) for key, name in RECORDED_DISTRIBUTIONS.items()}
    mcore = megatron_core_version()
    dists["megatron_core"] = None if mcore is None else ".".join(map(str, mcore))
    return {"sftprof": sftprof_version(), "python": platform.python_version(), "torch": dists.pop("torch"),
            "torch_cuda": torch_cuda, "nccl": nccl, **dists}


def _installed(name: str) -> Optional[str]:
    """The installed version of distribution ``name`` (``importlib.metadata``), None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def sftprof_version() -> Optional[str]:
    """sftprof's installed version, with ``+g<short commit>`` when this package is the top folder of a git checkout's
    ``sftprof/`` (``0.1.0+g85c64d7``: ``git rev-parse``, 5 s at most), and ``.dirty`` after it when the checkout has
    uncommitted changes to tracked files (``0.1.0+g85c64d7.dirty``: ``git diff --quiet HEAD``, 5 s at most; none
    when that fails): just the version without a checkout, without git, or when git fails or times out; None when
    sftprof is neither installed nor run from a source checkout. The version is that of the ``pyproject.toml`` of
    project ``sftprof`` beside the package when there is one (the code that runs: a checkout on ``PYTHONPATH``, even
    where another copy is installed), else the installed distribution's."""
    package = Path(__file__).resolve().parent
    version = _source_version(package.parent / "pyproject.toml") or _installed("sftprof")
    try:
        res = subprocess.run(["git", "-C", str(package), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return version
    lines = res.stdout.split()
    # the checkout must be this package's own: an installed copy inside another project's checkout is not
    if res.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != package.parent or version is None:
        return version
    try:  # exit status 1: tracked files differ from the commit (staged or not); 0: clean
        dirty = subprocess.run(["git", "-C", str(package), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=5).returncode == 1
    except (OSError, subprocess.TimeoutExpired):
        dirty = False
    return f"{version}+g{lines[1]}" + (".dirty" if dirty else "")


def _source_version(pyproject: Path) -> Optional[str]:
    """``[project].version`` of ``pyproject`` when it is sftprof's; None when it is absent, unreadable, another
    project's, or Python has no ``tomllib`` (3.10)."""
    if tomllib is None:
        return None
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project") or {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version")
    return version if project.get("name") == "sftprof" and isinstance(version, str) else None
