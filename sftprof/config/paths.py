"""Where a trial's files go, and which names may become a folder of those paths."""
from __future__ import annotations

import getpass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema imports this module (DEFAULT_FILEROOT)
    from sftprof.config.schema import SFTProfileConfig

# Not /tmp/sftprof (the default before): a folder named like the package shadows it for a Python started in its
# parent (``cd /tmp && python -c "import sftprof"`` imports the empty folder as a namespace package).
DEFAULT_FILEROOT = "/tmp/sftprof_fileroot"
# Names that become one folder of a path (experiment_name, trial_name, the driver's EXPERIMENT_NAME and
# PROFILE_STAMP): no '/', '.' or '..' can lead outside the folder they are put in.
NAME_ACCEPTED = "letters, digits, '_' and '-' only"


def is_folder_name(text: str) -> bool:
    """True when ``text`` is a non-empty name of :data:`NAME_ACCEPTED` characters (safe as one path component)."""
    return text.replace("_", "").replace("-", "").isalnum()


def trial_log_dir(cfg: SFTProfileConfig) -> Path:
    """LOG_DIR of a trial: ``<cluster.fileroot>/logs/<user>/<experiment_name>/<trial_name>/``."""
    return Path(cfg.cluster.fileroot) / "logs" / getpass.getuser() / cfg.experiment_name / cfg.trial_name
