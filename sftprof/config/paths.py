"""Where a trial's files go, and which names may become a folder of those paths."""
from __future__ import annotations

import getpass
from pathlib import Path

from sftprof.config.schema import SFTProfileConfig  # (the schema imports nothing of this module: no circle)

# cluster.fileroot unset (empty, the schema's default): the driver's is RUN_ROOT/<RUN_ROOT_FILEROOT> (one per user and
# run), the trainer's run alone /tmp/sftprof_fileroot_<user> (standalone_fileroot). Not /tmp/sftprof (a default
# before): a folder named like the package shadows it for a Python started in its parent (``cd /tmp && python -c
# "import sftprof"``).

def standalone_fileroot() -> str:
    """The log root of a trial run without the driver and without ``cluster.fileroot``: this user's own."""
    return f"/tmp/sftprof_fileroot_{getpass.getuser()}"


def trial_log_dir(cfg: SFTProfileConfig) -> Path:
    """LOG_DIR of a trial: ``<cluster.fileroot>/logs/<user>/<experiment_name>/<trial_name>/`` (an empty
    ``cluster.fileroot``: :func:`standalone_fileroot`; the driver always sets it)."""
    root = cfg.cluster.fileroot or standalone_fileroot()
    return Path(root) / "logs" / getpass.getuser() / cfg.experiment_name / cfg.trial_name
