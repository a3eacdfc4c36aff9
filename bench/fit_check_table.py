"""The fit check's prediction against the measured runs (CPU; prints bench/NOTES.md's table).

Each run of ``tests/fixtures/measured_peaks/runs.json`` is planned as the driver plans it (its variables and
arguments on the README's one-GPU slice, :data:`SLICE_ENV` and :data:`SLICE_ARGS`, or on what the run gives instead
as ``slice_env`` and ``slice_args``: a simulated rank of the shipped layout takes none), and its predicted peak
allocated, prediction error margin and need (:mod:`sftprof.analysis.memory.fit`) are set against the measured peak
(from its docs/examples summary, or the figure the fixture records) and the outcome.

    PYTHONPATH=$PWD python bench/fit_check_table.py
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sftprof.allocation import parse_allocation_mode  # noqa: E402
from sftprof.analysis.memory.fit import check_fit  # noqa: E402
from sftprof.config import load_config  # noqa: E402
from sftprof.launch.plan_types import PlanLog  # noqa: E402
from sftprof.launch.planning import read_driver_env  # noqa: E402
from sftprof.models.hf import load_hf_config  # noqa: E402

RUNS = ROOT / "tests" / "fixtures" / "measured_peaks" / "runs.json"
SLICE_ENV = {"N_GPUS_PER_NODE": "1", "TRAIN_BATCH_SIZE": "1", "PROFILE_N_MBS": "1", "PROFILE_STEPS": "2",
             "TOTAL_STEPS": "3", "PROFILE_RANKS": ""}
SLICE_ARGS = ["actor.backend=megatron:d1", "actor.num_layers=4"]
_PEAK = re.compile(r"peak allocated in the profiled step \*\*([0-9.]+) GiB\*\*")


def measured_peak_gib(run: dict) -> float | None:
    """The run's measured peak allocated (GiB): its summary's profiled-step peak, else the fixture's figure."""
    if run.get("summary"):
        return float(_PEAK.search((ROOT / run["summary"]).read_text()).group(1))
    return run.get("peak_allocated_gib")


def predict(run: dict, fileroot: str) -> dict:
    """:func:`check_fit` of the run as the driver would plan it on its GPU (the config its variables and arguments
    give; the model's package checks of the plan left out: fla need not be installed here), with the run's
    megatron-core (``megatron_core``: the memory outside PyTorch it holds), not the one installed here."""
    env = {**run.get("slice_env", SLICE_ENV), "CONFIG": str(ROOT / run["config"]),
           "PROFILE_FAKE_SEQ_LEN": str(run["seq_len"]), "FILEROOT": fileroot, **run["env"]}
    log = PlanLog()
    d = read_driver_env(env, run.get("slice_args", SLICE_ARGS) + run["args"], log)
    cfg = load_config(d.config, d.overrides + d.extra_overrides)
    return check_fit(dataclasses.asdict(cfg), load_hf_config(cfg.actor.path, cfg.actor.num_layers),
                     parse_allocation_mode(cfg.actor.backend), cfg.profile.fake_seq_len,
                     int(run["capacity_gib"] * 2**30), env.get("PYTORCH_CUDA_ALLOC_CONF"),
                     versions={"megatron_core": run["megatron_core"]})


def main() -> None:
    import tempfile

    runs = json.loads(RUNS.read_text())["runs"]
    print("| run | predicted peak GiB (phase) | measured GiB | error % | prediction error margin GiB | "
          "need / capacity GiB | predicted | outcome |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            fit = predict(run, tmp)
            g = 2**30
            meas = measured_peak_gib(run)
            err = f"{100 * (fit['peak_bytes'] / g - meas) / meas:+.1f}" if meas else "–"
            print(f"| {run['name']} | {fit['peak_bytes'] / g:.2f} ({fit['prediction']['phase']}) | "
                  f"{f'{meas:.2f}' if meas else '–'} | {err} | {fit['margin_bytes'] / g:.2f} | "
                  f"{fit['need_bytes'] / g:.2f} / {run['capacity_gib']} | "
                  f"{'fits' if fit['fits'] else 'oom'} | {run['outcome']} |")


if __name__ == "__main__":
    main()
