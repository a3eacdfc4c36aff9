"""One profiled training step per layout through the driver, and one table side by side (issue 18's measure).

    python bench/step.py --layouts megatron:d1 --json step_1gpu.json                              # 1x H200
    python bench/step.py --layouts 'megatron:(attn:c2|ffn:e2)' --baseline step_1gpu.json           # 2x H200
    python bench/step.py --layouts megatron:d1 'megatron:(attn:c2|ffn:e2)' -- actor.megatron.cp_attention=blocks
    python bench/step.py --runs RUN_ROOT_1GPU RUN_ROOT_2GPU        # rows from driver runs made earlier
    python bench/step.py --layouts 'megatron:(attn:c2|ffn:e2)' \
        'megatron:(attn:c2|ffn:e2)@actor.megatron.cp_comm_overlap=false'  # A/B: one setting per row
    python bench/step.py --layouts megatron:d1 megatron:d1@actor.megatron.transformer_impl=local  # TE vs local

Each layout runs ``run_qwen3_30b_a3b_sft_profile.sh`` once: the shipped YAML (``--config``) with its own
precision settings where Transformer Engine imports (TE's FusedAdam, bf16 main grads), else, and in rows that hide
TE (``LAYOUT@actor.megatron.transformer_impl=local``: local specs), with the fp32 optimizer; ``--layers`` decoder
layers, one
sequence of ``--seq`` tokens per data-parallel rank per step (one sequence at DP = 1), ``--steps`` steps of
which the last is profiled (one kernel trial, every rank traced; ``--kinds kernel,memory`` adds the memory trial of
the same step, so one invocation is also the shipped YAML's both-kinds check). Arguments after ``--`` are config
overrides for every layout; ``LAYOUT@key=value[@key=value...]`` adds overrides for that row only (its label is the
whole spec), so one invocation compares a setting on and off. The row of a layout is read from its kernel trial's
``profile_summary.json`` (:func:`trial_row`):

- ``step_s``: the profiled step's wall time in ``stats.jsonl`` (max over ranks), and ``unprofiled_step_s``:
  the step before it, which keeps no trace (it is the profiler's warm-up step: the profiler runs, so it is not free of
  the profiler's overhead either; ``--steps`` >= 3 so that it is not the warm-up step 0 of the run; none, shown
  ``-``, for a ``--runs`` trial that profiled step 1, whose step before is step 0);
- ``attn_ms``: attention-core GPU time per rank (model part ``attn_core``: forward, recompute and backward
  kernels inside the attention modules), the maximum over ranks; ``attn_fwd_tflops`` / ``attn_bwd_tflops``:
  achieved model TFLOP/s of attention kernels on the rank with the most attention time (the summary's
  kernel-efficiency rows; backward FLOPs = 2x forward); ``experts_ms``: the routed experts' GPU time (model part
  ``experts``), the maximum over ranks;
- ``exposed_comm_ms``: NCCL kernel time not overlapped with compute on that rank (max over ranks) and its
  share of the step; ``exposed_wait_ms``: the part of that rank's exposed time spent waiting for another rank to
  join the collective (load imbalance before it, not transfer; the summary's ``comm_wait``, matched call by
  call; ``-`` where the traces were not split); ``gpu_busy_pct`` (min over ranks);
- ``peak_gib``: peak allocated memory of the profiled step (max over ranks, ``stats.jsonl``); ``mfu``;
- ``projected_step_s`` / ``projected_exposed_ms``: a simulated rank's projected step and its exposed communication
  (the summary's ``simulation.projection``: measured compute plus the layout's collectives; ``-`` for a real run);
- ``expert_max_over_mean`` / ``ep_max_over_mean``: the profiled step's MoE routing at its worst layer (the
  summary's Steps table): the busiest expert's tokens over the mean per expert (16.0 = one expert of 128 at top-8
  took every token: the routing of random weights) and the busiest EP rank's over the mean per EP rank.

Ratios against the one-GPU row (of this run, or of ``--baseline`` JSON written by an earlier run): the
issue's goals are attention per rank <= 0.55x at CP = 2, two-GPU step <= 0.55x, exposed communication
<= 3 % of the step. Before the first layout runs, every row's driver run is checked as the driver would
(:func:`check_layout`): a bad setting in any row stops the bench with exit status 2 and nothing run or written.
Exit status: 0 when every layout's trial succeeded, else 1 (its row names the status).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sftprof.allocation import parse_allocation_mode  # noqa: E402
from sftprof.analysis.schema import processed_traces, read_summary  # noqa: E402
from sftprof.analysis.time.schema import EfficiencyRow
from sftprof.artifacts import SUMMARY_JSON  # noqa: E402
from sftprof.launch.arguments import arguments_setting  # noqa: E402
from sftprof.models.specs import have_transformer_engine  # noqa: E402

DRIVER_ENV = {"PROFILE_N_MBS": "1", "PROFILE_RANKS": ""}
# Without Transformer Engine (not installed, or hidden by actor.megatron.transformer_impl=local) the shipped
# precision-aware optimizer cannot run: such rows train with the fp32 optimizer.
NO_TE_ENV = {"USE_PRECISION_AWARE_OPTIMIZER": "false", "MAIN_GRADS_DTYPE": "float32"}
COLUMNS = (("layout", "layout", "{}"), ("gpus", "world_size", "{}"), ("step s", "step_s", "{:.3f}"),
           ("prev. step s", "unprofiled_step_s", "{:.3f}"), ("attn ms/rank", "attn_ms", "{:.1f}"),
           ("attn fwd TF/s", "attn_fwd_tflops", "{:.0f}"), ("attn bwd TF/s", "attn_bwd_tflops", "{:.0f}"),
           ("experts ms", "experts_ms", "{:.1f}"),
           ("exp. comm ms", "exposed_comm_ms", "{:.1f}"), ("exp. comm %", "exposed_comm_pct", "{:.1f}"),
           ("of which wait ms", "exposed_wait_ms", "{:.1f}"),
           ("GPU busy %", "gpu_busy_pct", "{:.1f}"), ("peak GiB", "peak_gib", "{:.2f}"),
           ("proj. step s", "projected_step_s", "{:.3f}"), ("proj. exp. comm ms", "projected_exposed_ms", "{:.1f}"),
           ("MFU", "mfu", "{:.3f}"),
           ("expert max/mean", "expert_max_over_mean", "{:.2f}"), ("EP max/mean", "ep_max_over_mean", "{:.2f}"))


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _attention_tflops(rows: list[EfficiencyRow]) -> dict[str, Optional[float]]:
    """Model TFLOP/s of the summary's attention efficiency rows, forward (first pass and recompute) and backward."""
    acc = {"forward": [0.0, 0.0], "backward": [0.0, 0.0]}
    for r in rows:
        if r["kind"] != "attention" or not r["gpu_ms"]:
            continue
        a = acc["backward" if r["phase"] == "backward" else "forward"]
        a[0] += r["tflop"]
        a[1] += r["gpu_ms"]
    return {k: (t / (ms / 1e3) if ms else None) for k, (t, ms) in acc.items()}


def trial_row(run_dir: Path) -> dict[str, Any]:
    """The table row of one kernel trial from its ``profile_summary.json`` (see the module docstring).

    Raises:
        SummaryReadError: no readable ``profile_summary.json`` in ``run_dir`` (or one of a newer sftprof).
    """
    summary = read_summary(run_dir / SUMMARY_JSON)
    steps = {s["step"]: s for s in summary["stats"]["steps"]}
    profiled = summary["profile_step"]
    traces = processed_traces(summary)

    def part_ms(t, part):
        return next((p["total_ms"] for p in t["summary"]["parts"]["summed"] if p["part"] == part), None)

    attn = {t["rank"]: part_ms(t, "attn_core") for t in traces}
    experts = [v for v in (part_ms(t, "experts") for t in traces) if v is not None]
    attn_known = {r: v for r, v in attn.items() if v is not None}
    busiest = max(attn_known, key=attn_known.get) if attn_known else None
    rates = _attention_tflops(next(t for t in traces if t["rank"] == busiest)["summary"]["efficiency"]["rows"]) \
        if busiest is not None else {"forward": None, "backward": None}
    step_s = _num((steps.get(profiled) or {}).get("step_time_s"))
    on_gpu = [t for t in traces if t["summary"]["gpu"]["activities"]]  # CPU runs: no GPU figures
    exposed = [t["summary"]["communication"]["exposed_ms"] for t in on_gpu]
    worst = max(on_gpu, key=lambda t: t["summary"]["communication"]["exposed_ms"])["rank"] if on_gpu else None
    waits = {r["rank"]: _num(r["exposed_wait_ms"]) for r in (summary.get("comm_wait") or {"ranks": []})["ranks"]}
    busy = [t["summary"]["gpu"]["busy_share_pct"] for t in on_gpu if _num(t["summary"]["gpu"]["busy_share_pct"])]
    moe = (steps.get(profiled) or {}).get("moe") or {}
    projection = (summary.get("simulation") or {}).get("projection") or {}
    return {
        "trial": summary["trial"], "status": summary["status"], "ranks_traced": len(traces),
        "step_s": step_s, "unprofiled_step_s": _num((steps.get(profiled - 1) or {}).get("step_time_s"))
        if isinstance(profiled, int) and profiled >= 2 else None,  # step 0 warms up: never the reference
        "attn_ms": attn_known[busiest] if busiest is not None else None, "attn_rank": busiest,
        "attn_fwd_tflops": rates["forward"], "attn_bwd_tflops": rates["backward"],
        "experts_ms": max(experts) if experts else None,
        "exposed_comm_ms": max(exposed) if exposed else None,
        "exposed_comm_pct": 100 * max(exposed) / (step_s * 1e3) if exposed and step_s else None,
        "exposed_wait_ms": waits.get(worst),
        "gpu_busy_pct": min(busy) if busy else None,
        "peak_gib": _num((steps.get(profiled) or {}).get("mem_peak_allocated_gb")),
        "mfu": _num((steps.get(profiled) or {}).get("mfu")),
        "expert_max_over_mean": _num(moe.get("max_over_mean")), "ep_max_over_mean": _num(moe.get("ep_max_over_mean")),
        "projected_step_s": projection["projected_step_ms"] / 1e3 if _num(projection.get("projected_step_ms")) else None,
        "projected_exposed_ms": _num(projection.get("exposed_ms")),
    }


def _problem(row: dict) -> Optional[str]:
    """``<model>_fake<len>`` of a row's trial name (the driver's ``<model>_fake<len>_<kind>_step<N>_<stamp>``)."""
    trial = row.get("trial") or ""
    return trial.split("_kernel_step")[0] if "_kernel_step" in trial else None


def ratios(rows: list[dict], baseline: Optional[dict]) -> list[dict]:
    """Each multi-GPU row against the one-GPU row ``baseline``: attention per rank, step, and the goals; a row of
    another model or sequence length (its trial name's ``<model>_fake<len>``) gets ``"skipped"`` instead.

    ``exposed_comm_pct`` also carries ``wait_pct`` where the row has its exposed wait: the part of the exposed
    share (% of the step, same rank) spent waiting for another rank, ``pct * exposed_wait_ms / exposed_comm_ms``;
    the rest is transfer that overlap could still hide."""
    out = []
    for r in rows:
        if baseline is None or r is baseline or r.get("status") != "ok" or (r.get("world_size") or 1) == 1:
            continue
        line = {"layout": r["layout"], "vs": baseline["layout"]}
        if None not in (_problem(r), _problem(baseline)) and _problem(r) != _problem(baseline):
            out.append(dict(line, skipped=f"no ratios: another model or sequence length ({_problem(r)} vs "
                                          f"{_problem(baseline)})"))
            continue
        for key, goal in (("attn_ms", 0.55), ("step_s", 0.55)):
            a, b = _num(r.get(key)), _num(baseline.get(key))
            line[key] = {"ratio": a / b if a is not None and b else None, "goal": goal}
        pct, exposed, wait = (_num(r.get(k)) for k in ("exposed_comm_pct", "exposed_comm_ms", "exposed_wait_ms"))
        line["exposed_comm_pct"] = {"value": pct, "goal": 3.0}
        if None not in (pct, exposed, wait) and exposed > 0:  # the share of it spent waiting for another rank
            line["exposed_comm_pct"]["wait_pct"] = pct * wait / exposed
        out.append(line)
    return out


def format_table(rows: list[dict], lines: list[dict]) -> str:
    """The side-by-side table and the ratio lines as text."""
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else f.format(r[k])) for _, k, f in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    text = ["  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i]) for i in range(len(c)))
            for c in cells]
    for r in rows:
        if r.get("status") != "ok":
            name = r["layout"] or r["run_root"]
            text.append(f"{name}: trial status {r.get('status')!r} (run dir {r.get('run_dir')})")
    for line in lines:
        if "skipped" in line:
            text.append(f"{line['layout']} vs {line['vs']}: {line['skipped']}")
            continue
        parts = []
        for key, label in (("attn_ms", "attention per rank"), ("step_s", "step")):
            ratio, goal = line[key]["ratio"], line[key]["goal"]
            parts.append(f"{label} {'-' if ratio is None else format(ratio, '.3f') + 'x'} (goal <= {goal}x)")
        pct, goal = line["exposed_comm_pct"]["value"], line["exposed_comm_pct"]["goal"]
        wait = line["exposed_comm_pct"].get("wait_pct")
        split = "" if wait is None else f": {pct - wait:.1f} % transfer, {wait:.1f} % waiting for another rank"
        parts.append(f"exposed comm {'-' if pct is None else format(pct, '.1f') + ' %'} of the step (goal <= {goal} %)"
                     + split)
        text.append(f"{line['layout']} vs {line['vs']}: " + "; ".join(parts))
    return "\n".join(text)


def _backend_of(log_dirs: list[Path], run_dir: Path) -> Optional[str]:
    """``actor.backend`` of a trial: the ``config.yaml`` of the first readable LOG_DIR of ``log_dirs`` (the one
    ``summary.tsv`` records, then the one the trial's ``profile_summary.json`` names: a run re-postprocessed where
    it was copied to), else the last ``actor.backend=`` line of the run dir's ``train_args.txt``; None when none is
    readable."""
    import yaml

    for log_dir in log_dirs:
        try:
            return yaml.safe_load((log_dir / "config.yaml").read_text())["actor"]["backend"]
        except (OSError, KeyError, TypeError, yaml.YAMLError):
            pass
    try:
        lines = (run_dir / "train_args.txt").read_text().splitlines()
    except OSError:
        return None
    values = [x.split("=", 1)[1] for x in lines if x.startswith("actor.backend=")]
    return values[-1] if values else None


def run_root_row(run_root: Path, extra: Optional[dict] = None) -> dict:
    """The row of the last-step kernel trial listed in ``run_root/summary.tsv`` (a driver run root; its what-if trials,
    another configuration, left out). A run root copied or moved from the machine that ran it is read from where it
    is now (``run_root/<trial>``). Layout: :func:`_backend_of`; world size: from the layout, else the trial's
    completion record."""
    row: dict[str, Any] = {"layout": None, "world_size": None, "run_root": str(run_root), **(extra or {})}
    try:
        with open(run_root / "summary.tsv") as f:
            kernel = [t for t in csv.DictReader(f, delimiter="\t")   # not run: STOP_ON_FAILURE; what-if trials
                      if t.get("kind") == "kernel" and t.get("status") != "not run" and t.get("what_if", "-") == "-"]
        if not kernel:
            raise ValueError("no kernel trial in summary.tsv")
        trial = max(kernel, key=lambda t: int(t["step"]))
        run_dir = run_root / trial["trial"]  # where the driver puts it; summary.tsv's path if it is not there
        if not run_dir.is_dir():
            run_dir = Path(trial["run_dir"])
        row["run_dir"] = str(run_dir)
        row.update(trial_row(run_dir))
        summary = read_summary(run_dir / SUMMARY_JSON)
        backend = _backend_of([Path(d) for d in (trial["log_dir"], summary["paths"]["log_dir"]) if d], run_dir)
        row.update(layout=backend or f"unknown layout ({run_root.name})",
                   world_size=parse_allocation_mode(backend).world_size if backend else
                   summary["completion"]["world_size"])
    except (OSError, KeyError, TypeError, ValueError) as err:
        row.update(status=f"no kernel trial summary ({type(err).__name__}: {err})")
    return row


def split_layout_spec(spec: str) -> tuple[str, list[str]]:
    """``LAYOUT@key=value@...`` -> ``(LAYOUT, ["key=value", ...])``. Raises ValueError naming the spec: a bad
    layout (:func:`parse_allocation_mode`'s message) or an override that is not ``key=value``."""
    layout, *extra = spec.split("@")
    parse_allocation_mode(layout)
    bad = [x for x in extra if "=" not in x or not x.split("=", 1)[0]]
    if bad:
        raise ValueError(f"overrides after '@' must be key=value, got {bad}")
    return layout, extra


def driver_call(spec: str, args, overrides: list[str], out_dir: Path, stamp: str) -> tuple[dict, list[str], Path]:
    """``(env, command, run_root)`` of the driver run for one layout spec (``LAYOUT[@key=value...]``), its run root
    named after the layout, the number of row overrides and ``stamp``. Raises ValueError as :func:`split_layout_spec`."""
    layout, extra = split_layout_spec(spec)
    parsed = parse_allocation_mode(layout)
    name = layout.replace(':', '_').replace('|', '_').replace('(', '').replace(')', '')
    run_root = out_dir / f"{name}_{stamp}" if not extra else out_dir / f"{name}_{len(extra)}ov_{stamp}"
    env = {k: v for k, v in os.environ.items() if k != "CONFIG"}
    impls = arguments_setting("actor.megatron.transformer_impl", overrides + extra)
    if (impls and impls[-1].partition("=")[2].strip() == "local") or not have_transformer_engine():
        env.update(NO_TE_ENV)
    env.update(DRIVER_ENV, PROFILE_KINDS=args.kinds, CONFIG=args.config, TRAIN_BATCH_SIZE=str(parsed.dp),
               RUN_ROOT=str(run_root), N_GPUS_PER_NODE=str(parsed.world_size),
               PROFILE_FAKE_SEQ_LEN=str(args.seq), PROFILE_STEPS=str(args.steps - 1), TOTAL_STEPS=str(args.steps),
               PROFILE_STAMP=stamp, FILEROOT=str(out_dir / "fileroot"))
    cmd = ["bash", str(REPO / "run_qwen3_30b_a3b_sft_profile.sh"), f"actor.backend={layout}"]
    # the row's own value of a key replaces the common one (the driver refuses a key given twice)
    common = ([f"actor.num_layers={args.layers}"] if args.layers else []) + overrides
    row_keys = {e.split("=", 1)[0] for e in extra}
    common = [o for o in common if o.split("=", 1)[0] not in row_keys]
    return env, cmd + common + extra, run_root


def check_layout(spec: str, args, overrides: list[str], out_dir: Path) -> None:
    """Validate one layout spec's driver run as the driver would (:func:`sftprof.launch.plan`, given the GPUs
    its layout needs), writing and launching nothing, so that a bad row override stops the bench before the
    first layout runs. Raises ValueError (``sftprof.launch.DriverError`` included) naming the setting."""
    from sftprof.launch import plan

    env, cmd, _ = driver_call(spec, args, overrides, out_dir, "check")
    env["RUN_ROOT"] = str(out_dir / f".check_{os.getpid()}")  # absent: plan refuses only a non-empty RUN_ROOT
    plan(env, cmd[2:], gpus=int(env["N_GPUS_PER_NODE"]))


def run_layout(spec: str, args, overrides: list[str], out_dir: Path) -> dict:
    """Run the driver for one layout spec (``LAYOUT[@key=value...]``: the last step's kernel trial, and its memory
    trial with ``--kinds kernel,memory``) and return the kernel trial's row, labelled ``spec``."""
    parsed = parse_allocation_mode(split_layout_spec(spec)[0])
    env, cmd, run_root = driver_call(spec, args, overrides, out_dir, time.strftime("%Y%m%d_%H%M%S"))
    proc = subprocess.run(cmd, env=env, text=True)
    row = run_root_row(run_root, {"sequences": parsed.dp, "driver_exit": proc.returncode})
    row.update(layout=spec, world_size=row["world_size"] or parsed.world_size)
    if proc.returncode:  # also when the kernel trial is fine and the memory trial failed
        row["status"] = f"driver exit {proc.returncode} (its output is above); kernel trial: {row.get('status')}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=[], help="actor.backend values, e.g. megatron:d1")
    ap.add_argument("--runs", nargs="+", type=Path, default=[],
                    help="driver run roots made earlier (e.g. kernel+memory trials for the summaries): their "
                         "last-step kernel trials become rows without running anything")
    ap.add_argument("--config", default=str(REPO / "qwen3_30b_a3b_sft_profile.yaml"), help="driver CONFIG")
    ap.add_argument("--layers", type=int, default=4, help="actor.num_layers (0: the config's)")
    ap.add_argument("--seq", type=int, default=131072, help="tokens per sequence (one sequence per step)")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps per trial (>= 3): step 0 warms up, the last one is profiled, the one before it (the "
                         "profiler's warm-up step, no trace kept) is the reference")
    ap.add_argument("--kinds", choices=("kernel", "kernel,memory"), metavar="{kernel | kernel,memory}",
                    help="profile kinds per layout run here (PROFILE_KINDS; default kernel); the row always comes "
                         "from the kernel trial")
    ap.add_argument("--out-dir", type=Path, default=Path("bench_step_runs"), help="run roots go here")
    ap.add_argument("--baseline", type=Path, help="JSON of an earlier run whose one-GPU row is the reference")
    ap.add_argument("--json", type=Path, help="write the rows and ratios here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = ap.parse_args(argv[:cut]), argv[cut + 1:]  # overrides only after "--": a typo is an error
    if not args.layouts and not args.runs:
        ap.error("give --layouts to run, or --runs of earlier driver runs")
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: need >= 3 (step 0 warms up; the step before the profiled one, which keeps no trace, "
                 "is the reference)")
    if args.kinds and not args.layouts:
        ap.error(f"--kinds {args.kinds}: applies to --layouts run here; the rows of --runs come from their kernel "
                 "trials as they are")
    args.kinds = args.kinds or "kernel"
    if args.json and not args.json.resolve().parent.is_dir():
        ap.error(f"--json {args.json}: folder {args.json.resolve().parent} does not exist")
    if args.json and args.json.exists():
        ap.error(f"--json {args.json}: exists (rows of an earlier run, or a --baseline); never overwritten: "
                 "name a new file")
    missing = [str(r) for r in args.runs if not (r / "summary.tsv").is_file()]
    if missing:
        ap.error(f"--runs: no summary.tsv (not a driver run root) in {missing}")
    if len(set(args.layouts)) != len(args.layouts):
        ap.error(f"--layouts {args.layouts}: a spec is repeated (rows are told apart by their spec)")
    for spec in args.layouts:  # every row's spec and driver run are valid before the first one starts
        try:
            check_layout(spec, args, overrides, args.out_dir.resolve())
        except ValueError as err:
            ap.error(f"--layouts {spec!r}: {err}")
    baseline = None
    if args.baseline:
        try:
            baseline = next(r for r in json.loads(args.baseline.read_text())["rows"] if r.get("world_size") == 1)
        except (OSError, ValueError, KeyError, StopIteration) as err:
            ap.error(f"--baseline {args.baseline}: no readable one-GPU row ({type(err).__name__}: {err})")
    if args.layouts:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [existing for existing in map(run_root_row, args.runs)]
    rows += [run_layout(layout, args, overrides, args.out_dir.resolve()) for layout in args.layouts]
    baseline = baseline or next((r for r in rows if r.get("world_size") == 1 and r.get("status") == "ok"), None)
    lines = ratios(rows, baseline)
    print("\n" + format_table(rows, lines))
    if args.json:
        run_settings = ({"seq": args.seq, "layers": args.layers, "steps": args.steps, "kinds": args.kinds}
                        if args.layouts else {})
        args.json.write_text(json.dumps({"rows": rows, "ratios": lines, "overrides": overrides, **run_settings},
                                        indent=1))
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
