"""A memory trial's snapshots: each analysed (:func:`sftprof.analysis.memory.snapshot.analyze_snapshot`), plotted,
set against the theoretical memory of its rank (:mod:`sftprof.analysis.memory.estimate`) and archived into the run
dir with its plot and phases sidecar (:func:`snapshot_part`).

A snapshot that fails (whatever it raises) is that snapshot's error and is not archived; the archive, plot and
sidecar an earlier postprocess wrote under the same names stay as they are, listed in its entry (``kept_files``). A
plot that cannot be drawn (whatever matplotlib raises) is the plot's error alone (``plot_error``): the snapshot is
still analysed and archived, and an earlier plot under its name stays, listed in ``kept_files``. So is a file that
cannot be moved into place (a folder under its name): the plot's is its ``plot_error``; the sidecar's or the
snapshot's is the snapshot's error, found before either is moved (a sidecar moved in before a later failure of the
snapshot's move, another OSError, stays, named in ``phases_file``).

A snapshot that is not its rank's (:func:`_not_the_ranks`: its name's rank outside the trial's world size, its name's
coordinates other than ``rank_coords.json`` records for the rank, or a second snapshot of a rank already summarised)
is its error too, not analysed and not archived; an earlier postprocess's archive and plot under its name stay, listed
in ``kept_files``.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Mapping, cast

from sftprof import artifacts
from sftprof.allocation import parse_allocation_mode
from sftprof.analysis.trial import inputs
from sftprof.analysis.trial.inputs import TrialModel, World, file_error, outside_world
from sftprof.analysis.memory.estimate import estimate_memory, explain_estimate
from sftprof.analysis.memory.plot import plot_memory
from sftprof.analysis.memory.snapshot import analyze_snapshot, history_status
from sftprof.analysis.memory.safe_pickle import UnsafePickleError, safe_load_file
from sftprof.analysis.memory.schema import AllocatorSettings, Estimate, MemorySummary
from sftprof.analysis.trial.schema import Files, SkippedFile, SnapshotEntry
from sftprof.atomic import WriteError, copy_file, write_failed

__all__ = ["snapshot_part"]

_SNAP_SUFFIXES = (".pickle", ".pickle.gz")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Memory snapshots
# --------------------------------------------------------------------------------------------
def _snapshot_rank(name: str) -> tuple[int | None, dict[str, int] | None]:
    """Rank (and coordinates) read from a snapshot file name; ``(None, None)`` when it names no rank.

    The trainer's ``snapshot_rank<r>_pp<a>_dp<b>_cp<c>_tp<d>_ep<e>.pickle`` gives both; other names give
    the rank when they hold ``rank<r>`` or ``rank_<r>`` / ``rank-<r>`` (``snapshot_rank0.pickle``).
    """
    parsed = artifacts.parse_snapshot_name(name)
    if parsed:
        return parsed
    m = _RANK_IN_NAME.search(name)
    return (int(m.group(1)), None) if m else (None, None)


def _not_the_ranks(rank: int | None, coords: dict[str, int] | None, world: World,
                   recorded: Mapping[int, Any], summarised: Mapping[int, str]) -> str | None:
    """Why a snapshot whose name says rank ``rank`` at ``coords`` (:func:`_snapshot_rank`) is not summarised as that
    rank's (the error's text after its file), None when it may be: the rank outside the trial's ``world``
    (:func:`outside_world`); coordinates other than ``recorded[rank]`` (``rank_coords.json``,
    :func:`sftprof.analysis.trial.inputs.read_rank_coords`; compared on the name's keys it records as integers, not
    checked when it records none for the rank); a rank already in ``summarised`` (rank -> its snapshot's file name)."""
    outside = outside_world(rank, world)
    if outside or rank is None:
        return outside
    want = recorded.get(rank)
    if coords is not None and isinstance(want, dict):
        keys = [k for k in coords if isinstance(want.get(k), int)]
        if any(coords[k] != want[k] for k in keys):
            claimed, known = (" ".join(f"{k}{c[k]}" for k in keys) for c in (coords, want))
            return (f"the file name says rank {rank} is at {claimed}, but {artifacts.RANK_COORDS} records rank {rank} "
                    f"at {known}: not this trial's rank {rank} (a snapshot is summarised as rank {rank} only under "
                    "the coordinates recorded for it)")
    if rank in summarised:
        return (f"a second snapshot of rank {rank}; only {summarised[rank]} is summarised as rank {rank} (one "
                "snapshot a rank)")
    return None


def _kept(run_dir: str, dst_dir: str, names: set[str | None]) -> list[str]:
    """The run-dir relative paths of the files ``names`` (None: none) now in ``dst_dir``, sorted: what a failed
    snapshot leaves there (:func:`snapshot_part` drops those this postprocess wrote)."""
    return sorted(os.path.relpath(os.path.join(dst_dir, n), run_dir) for n in names
                  if n and os.path.isfile(os.path.join(dst_dir, n)))


def _estimate(log_dir: str, model: TrialModel, rank: int | None) -> tuple[Estimate | None, str | None]:
    """Theoretical memory of ``rank`` (:func:`sftprof.analysis.memory.estimate.estimate_memory`) of the trial's
    ``model``, and why not."""
    cfg, _ = inputs.trial_config(log_dir)  # (an unreadable one is the summary's error: postprocess_trial)
    if cfg is None or rank is None:
        return None, "no config.yaml in the log dir or no rank in the snapshot name: no theoretical estimate"
    try:
        a = cfg["actor"]
        layout = parse_allocation_mode(a["backend"])
        hf = model.config()
        return estimate_memory(cfg, hf, layout, layout.rank_coords(rank), int(cfg["profile"]["fake_seq_len"])), None
    except Exception as exc:  # an estimate that cannot be made is a note, never the trial's error
        return None, f"no theoretical estimate: {type(exc).__name__}: {exc}"


def _allocator_settings(snapshot: dict[str, Any]) -> AllocatorSettings | None:
    """``{"alloc_conf", "expandable_segments"}`` of the caching allocator that took the snapshot (its
    ``allocator_settings``, recorded by torch since 2.5; a value of another type is None); None without them."""
    settings = snapshot.get("allocator_settings")
    if not isinstance(settings, dict):
        return None
    conf, expandable = settings.get("PYTORCH_CUDA_ALLOC_CONF"), settings.get("expandable_segments")
    return {"alloc_conf": conf if isinstance(conf, str) else None,
            "expandable_segments": expandable if isinstance(expandable, bool) else None}


def _own_device(phases: Any, rank: int | None, log_dir: str) -> tuple[int | None, str | None]:
    """The rank's own CUDA device index and where it comes from: the phases sidecar's ``device`` (written by the
    trainer), else ``rank % cluster.n_gpus_per_node`` of the trial's config (torchrun's local rank), else
    ``(None, None)`` (then the device with the most reserved bytes is summarised)."""
    device = phases.get("device") if isinstance(phases, dict) else None
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device, "phases sidecar"
    cfg, _ = inputs.trial_config(log_dir)
    per_node = ((cfg or {}).get("cluster") or {}).get("n_gpus_per_node")
    if rank is not None and isinstance(per_node, int) and per_node >= 1:
        return rank % per_node, "local rank (rank % cluster.n_gpus_per_node)"
    return None, None


def _plot(raw: dict[str, Any], title: str, stage: str, png_name: str, dst_dir: str) -> str | None:
    """:func:`~sftprof.analysis.memory.plot.plot_memory` of ``raw`` into ``stage/png_name``; None when drawn, else the
    plot's error (named by its file in ``dst_dir``; whatever matplotlib raised: "not drawn", an OSError such as a
    full disk: "not written"), and no file of it is left in ``stage``."""
    try:
        plot_memory(raw, title, os.path.join(stage, png_name))
    except Exception as exc:  # a backend matplotlib refuses, a failed save: the plot's error, not the snapshot's
        if os.path.lexists(os.path.join(stage, png_name)):
            os.remove(os.path.join(stage, png_name))
        what = "written" if isinstance(exc, OSError) else "drawn"
        return f"{file_error(os.path.join(dst_dir, png_name), exc)} (memory plot not {what})"
    return None


def _move_in(stage: str, dst_dir: str, name: str) -> None:
    """Move ``stage/name`` to ``dst_dir/name``, replacing the file there.

    Raises:
        WriteError: it cannot be moved (a folder in its place); naming ``dst_dir/name``, which is left as it was.
    """
    try:
        os.replace(os.path.join(stage, name), os.path.join(dst_dir, name))
    except OSError as exc:
        raise write_failed(os.path.join(dst_dir, name), exc) from exc


def _snapshot_entry(log_dir: str, run_dir: str, src_dir: str, dst_dir: str, name: str, step: int,
                    max_entries: int | None, written: set[str], world: World, recorded: Mapping[int, Any],
                    summarised: Mapping[int, str], model: TrialModel) -> SnapshotEntry:
    """The summary entry of one snapshot: analysis (with its ``phases_rank<r>.json``), plot, estimate, or its error.

    The snapshot is read, analysed and plotted from the log dir; only then are the snapshot, its plot and its rank's
    phases sidecar moved into ``dst_dir`` (from a staging folder ``RUN_DIR/.staging_rank<r>_*``), replacing the
    files of an earlier postprocess. A snapshot that fails (whatever it raises) is that snapshot's error and is not
    archived (``"archived": false``, the error ends in ``(not archived...)``): no copy of it is written, and the
    archived snapshot, plot and sidecar of an earlier postprocess under the same names stay as they are, listed in
    ``kept_files`` (run-dir relative; a warning names them, :mod:`sftprof.analysis.trial.problems`; those this
    postprocess wrote, by another snapshot of the rank, are dropped by :func:`snapshot_part`). ``written``: names this
    postprocess wrote to ``dst_dir`` (updated).
    A snapshot that is not its rank's is an error too (snapshots hold no rank of their own, so the name is checked,
    :func:`_not_the_ranks`: against the world size ``world``, the coordinates ``recorded`` in ``rank_coords.json`` and
    the ranks ``summarised`` already): not analysed, not archived, an earlier archive and plot under its name listed in
    ``kept_files`` (not the rank's sidecar: the rank's summarised snapshot archives it). A plot that cannot
    be drawn, or moved into place, is the entry's ``plot_error`` alone (:func:`_plot`, :func:`_move_in`; an earlier
    plot stays, in ``kept_files``). A folder under the sidecar's or the snapshot's name fails the snapshot before
    anything is moved; the sidecar is moved before the snapshot, and when the snapshot's own move fails all the same
    (another OSError), the sidecar moved in is named in ``phases_file``.
    """
    rank, coords = _snapshot_rank(name)
    entry: SnapshotEntry = {"rank": rank, "file": os.path.relpath(os.path.join(dst_dir, name), run_dir),
                             "coords_from_name": coords}
    src = os.path.join(src_dir, name)
    png_name = re.sub(r"\.pickle(\.gz)?$", ".png", name)
    refused = _not_the_ranks(rank, coords, world, recorded, summarised)
    if refused:
        entry["error"] = f"{src}: {refused}; not analysed (not archived)"
        entry["archived"] = False
        kept = _kept(run_dir, dst_dir, {name, png_name})
        if kept:
            entry["kept_files"] = kept
        return entry
    phases_name = artifacts.phases_name(rank) if rank is not None else None
    stage = tempfile.mkdtemp(prefix=f".staging_rank{'' if rank is None else rank}_", dir=run_dir)
    try:
        try:
            copies: dict[str, str] = {}  # name in dst_dir -> the log dir's file to copy there as it is
            moved: list[str] = []  # of copies, those moved into dst_dir
            phases = None
            if phases_name and os.path.isfile(os.path.join(src_dir, phases_name)):
                with open(os.path.join(src_dir, phases_name), encoding="utf-8") as f:
                    phases = json.load(f)
                copies[phases_name] = os.path.join(src_dir, phases_name)
            print(f"[postprocess] analysing {name}", file=sys.stderr, flush=True)
            snapshot = safe_load_file(src)
            device, device_from = _own_device(phases, rank, log_dir)
            raw = analyze_snapshot(snapshot, phases, device)
            raw["device_from"] = device_from
            allocator = _allocator_settings(snapshot)
            plot_error = _plot(raw, f"{name} (step {step})", stage, png_name, dst_dir)
            raw.pop("series")
            raw["history"] = history_status(raw, max_entries)
            # analyze_snapshot gives a plain dict (memory/snapshot.py is not typed strictly): without its series and
            # with its history, a MemorySummary
            summary = cast(MemorySummary, raw)
            copies[name] = src
            for n, path in copies.items():  # the inputs, copied as they are
                try:
                    shutil.copyfile(path, os.path.join(stage, n))
                except OSError as exc:  # a full disk: named by the archive file it was to become
                    raise write_failed(os.path.join(dst_dir, n), exc) from exc
            for n in copies:  # a folder in the place of either fails the snapshot before anything is moved
                if os.path.isdir(os.path.join(dst_dir, n)):
                    blocked = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
                    raise write_failed(os.path.join(dst_dir, n), blocked)
            for n in copies:  # the sidecar, then the snapshot: an archive is never left without its sidecar
                _move_in(stage, dst_dir, n)
                moved.append(n)
        except Exception as exc:  # whatever one snapshot raises is that snapshot's error, never the whole run's
            why = (": opening it with pickle would run that global" if isinstance(exc, UnsafePickleError) else "")
            # The archive copy of an unsafe one would be run by whoever opens it with plain pickle
            # (torch.cuda._memory_viz does); a damaged one would look like a snapshot there. Neither is archived.
            entry["error"] = file_error(src, exc) + f" (not archived{why})"
            entry["archived"] = False
            written.update(moved)
            if phases_name is not None and phases_name in moved:  # moved in before the snapshot's move failed
                entry["phases_file"] = os.path.relpath(os.path.join(dst_dir, phases_name), run_dir)
            kept = _kept(run_dir, dst_dir, {name, png_name, phases_name})
            if kept:
                entry["kept_files"] = kept
            return entry
        written.update(moved)
        if plot_error is None:
            try:
                _move_in(stage, dst_dir, png_name)
                written.add(png_name)
            except WriteError as exc:  # a folder in its place: the plot's error alone
                plot_error = f"{file_error(os.path.join(dst_dir, png_name), exc)} (memory plot not written)"
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if phases_name is not None and phases_name in copies:
        entry["phases_file"] = os.path.relpath(os.path.join(dst_dir, phases_name), run_dir)
    if plot_error is None:
        entry["plot"] = os.path.relpath(os.path.join(dst_dir, png_name), run_dir)
    else:
        entry["plot_error"] = plot_error
        kept = _kept(run_dir, dst_dir, {png_name})  # an earlier postprocess's
        if kept:
            entry["kept_files"] = kept
    entry["summary"] = summary
    entry["allocator"] = allocator
    estimate, note = _estimate(log_dir, model, rank)
    entry["estimate"], entry["estimate_note"] = estimate, note
    entry["estimate_vs_measured"] = explain_estimate(raw, estimate)
    return entry


def snapshot_part(log_dir: str, run_dir: str, step: int, world: World, model: TrialModel) -> Files:
    """``{"memory_snapshots": [...], "skipped": [...]}``: each snapshot of the step's snapshot dir analysed and, when
    that succeeded, archived to the run dir as is with its plot and phases sidecar (:func:`_snapshot_entry`: a
    snapshot that fails is not archived, and an earlier postprocess's archive and plot of it stay). One snapshot a
    rank is summarised: the first by name that is its rank's and processed without error; a further one, or one whose
    name contradicts ``rank_coords.json`` (when readable), is its file's error. The folder's other files (skipped ones,
    sidecars of ranks without a snapshot there) are copied as they are. ``model``: the trial's model, for each
    snapshot's theoretical estimate."""
    src_dir = str(artifacts.snapshot_dir(log_dir, step))
    dst_dir = str(artifacts.snapshot_dir(run_dir, step))
    snapshots: list[SnapshotEntry] = []
    skipped: list[SkippedFile] = []
    if not os.path.isdir(src_dir):
        return {"memory_snapshots": snapshots, "skipped": skipped}
    try:
        os.makedirs(dst_dir, exist_ok=True)
    except OSError as exc:  # a file in a folder's place: each file's move into dst_dir fails and is its error
        blocked: WriteError | None = write_failed(dst_dir, exc)
    else:
        blocked = None
    names = sorted(os.listdir(src_dir))
    snaps = [n for n in names if n.endswith(_SNAP_SUFFIXES) and os.path.isfile(os.path.join(src_dir, n))]
    sidecars = {artifacts.phases_name(r) for r in (_snapshot_rank(n)[0] for n in snaps) if r is not None}
    max_entries = inputs.max_entries(log_dir)
    recorded, _ = inputs.read_rank_coords(log_dir)  # an unreadable one is the summary's error: no check against it
    written: set[str] = set()
    summarised: dict[int, str] = {}  # rank -> the file name of its snapshot summarised
    for name in names:
        if name in snaps:
            entry = _snapshot_entry(log_dir, run_dir, src_dir, dst_dir, name, step, max_entries, written, world,
                                    recorded, summarised, model)
            if "error" not in entry and entry["rank"] is not None:
                summarised[entry["rank"]] = name
            snapshots.append(entry)
            continue
        if not artifacts.PHASES_RE.match(name):
            skipped.append({"file": os.path.relpath(os.path.join(src_dir, name), log_dir),
                            "reason": "not a snapshot (*.pickle, *.pickle.gz) or a phases_rank<r>.json sidecar"})
        if name not in sidecars and os.path.isfile(os.path.join(src_dir, name)):
            if blocked is None:
                copy_file(os.path.join(src_dir, name), os.path.join(dst_dir, name))
            else:
                skipped.append({"file": os.path.relpath(os.path.join(src_dir, name), log_dir),
                                "reason": f"not copied: {blocked}"})
    for entry in snapshots:  # a file this postprocess wrote (from another snapshot of the rank) is not an earlier one
        kept = [f for f in entry.get("kept_files") or [] if os.path.basename(f) not in written]
        if kept:
            entry["kept_files"] = kept
        else:
            entry.pop("kept_files", None)
    return {"memory_snapshots": snapshots, "skipped": skipped}
