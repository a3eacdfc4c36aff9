"""The folders a run makes: names and paths checked before anything is written, RUN_ROOT chosen and claimed, the
plan written into it (and removed again when a signal stops the plan).

Every folder the plan names must fit (255 bytes a name, 4095 a path); ``FILEROOT`` and ``RUN_ROOT`` must be places
where this user can make folders (a probe folder is made and removed at once); the user name must be one folder
name (:func:`log_user`). ``RUN_ROOT`` must not exist or be empty, and is claimed atomically when the plan is written
(:func:`write_plan`: its ``profile_settings.log`` is created only if absent), so two drivers planning into one
RUN_ROOT at once cannot both write there: the second is refused (exit 2) and writes nothing.
"""
from __future__ import annotations

import datetime as _dt
import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

from sftprof import artifacts
from sftprof.launch.signals import signals_held
from sftprof.launch.variables import DriverError, folder_name
from sftprof.launch.plan_types import DriverEnv, PlanLog, Probe, RunPlan, Trial


NAME_MAX = 255   # bytes in one folder name (Linux filesystems)
PATH_MAX = 4095  # bytes in a path (Linux: 4096 with the terminating NUL)
USER_VARIABLES = ("LOGNAME", "USER", "LNAME", "USERNAME")  # getpass.getuser()'s sources, in its order


def model_tag(model_path: str) -> str:
    """The ``<model>`` part of trial names: the folder name of ``model_path`` (``actor.path``) in lower case, each
    run of characters other than ASCII letters and digits replaced by one ``_`` (``Qwen3-30B-A3B`` ->
    ``qwen3_30b_a3b``, ``go od*`` -> ``go_od``), no ``_`` at either end; ``model`` when nothing is left."""
    return re.sub(r"[^a-z0-9]+", "_", Path(model_path.rstrip("/")).name.lower()).strip("_") or "model"


def seq_tag(n_tokens: int) -> str:
    """``131072`` -> ``"128k"``; lengths that are not a multiple of 1024 stay numeric."""
    return f"{n_tokens // 1024}k" if n_tokens % 1024 == 0 else str(n_tokens)


def trial_name(tag: str, fake_seq_len: int, kind: str, step: int, stamp: str) -> str:
    """A trial's name (its run dir and log dir): ``<model>_fake<len>_<kind>_step<N>_<stamp>``."""
    return f"{tag}_fake{seq_tag(fake_seq_len)}_{kind}_step{step}_{stamp}"


def _nbytes(text: str) -> int:
    return len(os.fsencode(text))


def check_path_fits(name: str, path: Path, what: str | None = None) -> None:
    """Raise DriverError naming variable ``name`` (or ``what`` the path is, when given) when a folder name in
    ``path`` is over :data:`NAME_MAX` bytes or the whole path over :data:`PATH_MAX` bytes (the filesystem would
    refuse it with ENAMETOOLONG)."""
    long = [part for part in path.parts if _nbytes(part) > NAME_MAX]
    shown = str(path) if len(str(path)) <= 120 else f"{str(path)[:100]}..."
    shown = f"{name}={shown}" if what is None else f"{what} {shown}"
    if long:
        raise DriverError(f"{shown}: its folder name {long[0][:40]}... is {_nbytes(long[0])} bytes long; "
                          f"accepted: folder names of at most {NAME_MAX} bytes")
    if _nbytes(str(path)) > PATH_MAX:
        raise DriverError(f"{shown}: is {_nbytes(str(path))} bytes long; accepted: a path of at most {PATH_MAX} bytes "
                          + ("" if what is None else f"(shorten {name})"))


def check_writable_folder(name: str, path: Path) -> None:
    """Raises DriverError naming ``name`` unless folders can be made under ``path``: its nearest existing ancestor
    (``path`` itself when it exists) is a folder in which a probe folder can be created; the probe is removed
    at once, so nothing is left behind (``path`` itself is not created here); its folder names and length must fit
    (:func:`check_path_fits`)."""
    check_path_fits(name, path)
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    try:
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is not a folder")
        with signals_held():  # a signal between the two is handled after the rmdir: no probe is left behind
            os.rmdir(tempfile.mkdtemp(prefix=".sftprof_probe_", dir=base))
    except OSError as err:
        raise DriverError(f"{name}={path}: cannot create folders there ({err}); accepted: a folder path that this "
                          "user can write (it is created if missing)") from err


def log_user() -> str:
    """The ``<user>`` folder of trial log dirs (``FILEROOT/logs/<user>/``, :func:`sftprof.config.trial_log_dir`):
    ``getpass.getuser()``, which is ``LOGNAME``, else ``USER``, ``LNAME``, ``USERNAME``, else the password database.

    Raises:
        DriverError: it is not one folder name that stays inside ``FILEROOT/logs`` (empty, ``.``, ``..``, holds a
            ``/``) or is over :data:`NAME_MAX` bytes; the message names the variable it came from.
    """
    user = getpass.getuser()
    source = next((v for v in USER_VARIABLES if os.environ.get(v)), "the password database")
    if user in ("", ".", "..") or "/" in user or _nbytes(user) > NAME_MAX:
        raise DriverError(f"user name {user[:60]!r} (from {source}): it names the folder FILEROOT/logs/<user> of the "
                          f"trainer logs and is not one folder name there; accepted: a name without '/', other than "
                          f"'.' and '..', of at most {NAME_MAX} bytes" +
                          (f" (set {source} to your user name)" if source in USER_VARIABLES else ""))
    return user


def check_folder_names(d: DriverEnv, p: Probe, stamp: str, node_tag: str) -> None:
    """Raise DriverError, naming the variable and the limit, when a folder the driver or the trainer would make is
    named over :data:`NAME_MAX` bytes: ``<experiment>`` (the log dirs' parent), the trial names (from
    ``PROFILE_STAMP``, else the model folder name) and RUN_ROOT's default ``<experiment>_<stamp>[_node<k>]``; or the
    user name is unusable (:func:`log_user`)."""
    log_user()
    exp = p.cfg.experiment_name
    exp_name = "EXPERIMENT_NAME" if d.get("EXPERIMENT_NAME") else "experiment_name"
    if _nbytes(exp) > NAME_MAX:
        raise DriverError(f"{exp_name} is {_nbytes(exp)} bytes long: it names the folder "
                          f"FILEROOT/logs/<user>/<experiment> and a folder name can have at most {NAME_MAX} bytes; "
                          f"use at most {NAME_MAX} bytes")
    tag = model_tag(p.cfg.actor.path)
    longest = max((trial_name(tag, p.cfg.profile.fake_seq_len, kind, step, stamp) for step in d.steps
                   for kind in p.kinds), key=_nbytes)
    if _nbytes(longest) > NAME_MAX:
        rest = _nbytes(longest) - _nbytes(stamp)
        if d.get("PROFILE_STAMP") and rest < NAME_MAX:
            raise DriverError(f"PROFILE_STAMP is {_nbytes(stamp)} bytes long: it ends the trial folder names "
                              f"({longest[:-len(stamp)]}<stamp> here) and a folder name can have at most {NAME_MAX} "
                              f"bytes; use at most {NAME_MAX - rest} bytes")
        rest = _nbytes(longest) - _nbytes(tag)
        raise DriverError(f"the model folder name of MODEL_PATH / actor.path ({tag[:40]}... after cleaning) is "
                          f"{_nbytes(tag)} bytes long: it starts the trial folder names (<model>_fake<len>_<kind>_step"
                          f"<N>_<stamp>) and a folder name can have at most {NAME_MAX} bytes; use a model folder name "
                          f"of at most {NAME_MAX - rest} bytes")
    default_run_root = f"{exp}_{stamp}{node_tag}"
    if not d.get("RUN_ROOT") and _nbytes(default_run_root) > NAME_MAX:
        raise DriverError(f"RUN_ROOT's default folder name <experiment>_<stamp>{node_tag} would be "
                          f"{_nbytes(default_run_root)} bytes long, and a folder name can have at most {NAME_MAX} "
                          f"bytes: shorten {exp_name} ({_nbytes(exp)} bytes) or PROFILE_STAMP ({_nbytes(stamp)} "
                          "bytes), or set RUN_ROOT")


def another_run_root(explicit: bool) -> str:
    """What to change when RUN_ROOT is taken: RUN_ROOT itself when it was set (``explicit``; PROFILE_STAMP then
    changes only the trial names), else PROFILE_STAMP (the default RUN_ROOT ends with it) or RUN_ROOT."""
    if explicit:
        return "Set RUN_ROOT to a new folder (PROFILE_STAMP does not change a RUN_ROOT that is set)"
    return "Set another PROFILE_STAMP (the default RUN_ROOT ends with it) or set RUN_ROOT to a new folder"


def choose_run_root(d: DriverEnv, p: Probe, log: PlanLog) -> tuple[Path, str]:
    """``(RUN_ROOT, PROFILE_STAMP)``; RUN_ROOT must not exist or be empty, and folders must be creatable there
    (:func:`check_writable_folder`); the folder names of the plan must fit (:func:`check_folder_names`)."""
    get = d.get
    if p.n_nodes > 1 and not get("PROFILE_STAMP"):
        raise DriverError(f"PROFILE_STAMP is unset with N_NODES={p.n_nodes}: set the same PROFILE_STAMP on every node "
                          "(trial names must match), and put FILEROOT on a filesystem all nodes share")
    stamp = get("PROFILE_STAMP") or _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    folder_name("PROFILE_STAMP", stamp)
    node_tag = f"_node{d.node_rank}" if d.node_rank else ""  # nodes may share the working directory
    check_folder_names(d, p, stamp, node_tag)
    run_root = Path(get("RUN_ROOT") or (Path.cwd() / "sftprof_runs" / f"{p.cfg.experiment_name}_{stamp}{node_tag}")
                    ).expanduser().resolve()
    check_path_fits("RUN_ROOT", run_root)
    if run_root.exists() and not run_root.is_dir():
        raise DriverError(f"RUN_ROOT={run_root}: exists and is not a directory; nothing was overwritten. "
                          + another_run_root(bool(get("RUN_ROOT"))))
    if run_root.exists() and any(run_root.iterdir()):
        raise DriverError(f"RUN_ROOT={run_root}: exists and is not empty; nothing was overwritten. "
                          + another_run_root(bool(get("RUN_ROOT"))))
    check_writable_folder("RUN_ROOT", run_root)
    log.note("RUN_ROOT", run_root, "env" if get("RUN_ROOT") else "default ./sftprof_runs/<experiment>_<stamp>[_node<k>]")
    log.note("PROFILE_STAMP", stamp, "env" if get("PROFILE_STAMP") else "default: now")
    return run_root, stamp


def write_plan(trials: list[Trial], settings: list[str], run_plan: RunPlan, created: list[Path] | None = None) -> None:
    """Claim RUN_ROOT and write into it ``profile_settings.log``, ``plan_config.yaml`` (the CONFIG file as the plan
    read it, ``run_plan.config``, read-only: every trial loads it), ``trials.tsv`` and each trial's folder with its
    ``train_args.txt``.

    The claim is the creation of ``profile_settings.log`` only if it does not exist (``O_EXCL``): of two drivers
    that planned into one RUN_ROOT at once, one creates it and writes its plan; the other is refused and writes
    nothing more (the folders it made on the way are the winner's too, and stay). SIGINT and SIGTERM are held while
    it runs (:func:`signals_held`): it writes the whole plan, and ``created`` (when given) lists what it made, in
    order: each missing folder above and including RUN_ROOT, and when RUN_ROOT was there before (empty), each file
    and trial folder made in it; :func:`remove_plan` removes them.

    Raises:
        DriverError: another driver claimed RUN_ROOT first (``created`` is then emptied: nothing is the plan's).
    """
    created = [] if created is None else created
    run_root = run_plan.run_root
    with signals_held():
        missing = []
        folder = run_root
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # made by someone else meanwhile: not the plan's
                continue
            created.append(folder)
        own_root = run_root in created

        def made(path: Path) -> Path:
            if not own_root:
                created.append(path)
            return path

        try:
            with open(run_root / artifacts.PROFILE_SETTINGS, "x", encoding="utf-8") as claim:
                made(run_root / artifacts.PROFILE_SETTINGS)
                claim.write("\n".join(settings) + "\n")
        except FileExistsError:
            created.clear()  # what this driver made on the way holds the other run now
            raise DriverError(f"RUN_ROOT={run_root}: another driver claimed it while this one planned (its "
                              f"{artifacts.PROFILE_SETTINGS} appeared); nothing was written. "
                              + another_run_root(run_plan.run_root_set)) from None
        config = run_plan.config
        with open(made(Path(config.copy)), "xb") as f:  # read-only: the plan's, not to be edited
            f.write(config.text)
        os.chmod(config.copy, 0o444)
        rows = []
        for t in trials:
            t.run_dir.mkdir(parents=True, exist_ok=False)
            made(t.run_dir)
            rows.append(write_train_args(t))
        with open(made(run_root / artifacts.TRIALS_TSV), "x", encoding="utf-8") as tsv:
            tsv.write("\n".join(["\t".join(artifacts.TRIALS_HEADER), *rows]) + "\n")


def write_train_args(t: "Trial") -> str:
    """Write ``RUN_DIR/train_args.txt`` (the trainer's arguments, one per line) of a trial whose run dir exists, and
    return its row of ``trials.tsv``: name, kind, step, run dir, log dir, arguments file, tab-separated."""
    args_file = t.run_dir / artifacts.TRAIN_ARGS
    args_file.write_text("\n".join(t.args) + "\n")
    return "\t".join([t.name, t.kind, str(t.step), str(t.run_dir), str(t.log_dir), str(args_file)])


def remove_plan(run_root: Path | None, created: list[Path]) -> str:
    """Remove what :func:`write_plan` created (``created``, in the order made) after the plan was interrupted, and
    say in words what happened: ``nothing was written``; ``RUN_ROOT <path>, which the plan had created, was removed``
    (with the folders above it that it made); ``what the plan had written in RUN_ROOT <path> was removed (the folder
    was there before, empty: kept)``; or, when a removal fails, the error and each path left. Only paths in
    ``created`` are touched: a RUN_ROOT the plan made holds only what it wrote there (it refuses a non-empty one), and
    a folder above it is removed only when empty."""
    if not created:
        return "nothing was written"
    try:
        for path in reversed(created):
            if path.is_dir() and not path.is_symlink():
                if path == run_root or run_root in path.parents:
                    shutil.rmtree(path)
                else:
                    path.rmdir()  # a folder above RUN_ROOT the plan made: removed only when empty
            else:
                path.unlink()
    except OSError as err:
        left = [str(p) for p in created if os.path.lexists(p)]
        return (f"removing what the plan had written failed ({err.strerror}: {err.filename}); left: " + ", ".join(left)
                + " (remove them before using this RUN_ROOT again)")
    if run_root in created:
        above = [str(p) for p in created if p != run_root]
        return (f"RUN_ROOT {run_root}, which the plan had created, was removed"
                + (f", and the folder(s) it had made above it ({', '.join(above)})" if above else ""))
    return f"what the plan had written in RUN_ROOT {run_root} was removed (the folder was there before, empty: kept)"
