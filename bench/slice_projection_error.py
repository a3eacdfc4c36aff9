"""The slice projection's error against recorded real runs (CPU; prints bench/NOTES.md's tables).

Pairs of recorded one-GPU runs that differ only in layers or tokens (same GPU, same settings, both through the
driver, step 2 profiled). Only one pair has the part breakdown of its source run: the H200 TE trace fixture (2
layers, 8192 tokens, tests/fixtures/README.md) projected part by part to the 4-layer 131072-token slice
(:func:`sftprof.analysis.time.slice_projection.project_slice`); the others have step times alone, so they are
projected at the measured FLOP rate (the step times the model + recompute FLOP ratio, ``constant_rate_step_ms``).
Last, one simulated rank at 4, 8 and 16 layers (H100 summaries, tests/fixtures/README.md), each projected part by part
to the deeper ones (one rank and one step each: the target's steps 1 and 2 are both given).

    PYTHONPATH=$PWD python bench/slice_projection_error.py
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fixtures import FIXTURE_DIR, postprocessed_trial  # noqa: E402
from sftprof.analysis.time.slice_projection import project_slice, rank_slice  # noqa: E402
from sftprof.config import load_config  # noqa: E402

SLICE = ["actor.backend=megatron:d1", "cluster.n_gpus_per_node=1", "train_dataset.batch_size=1", "actor.mb_spec.n_mbs=1"]
# (name, NOTES section of the source, of the target, layers and tokens of each, step 2 s of each, settings)
STEP_PAIRS = [
    ("H100, TE, Qwen3-30B-A3B, chunk 2048 + expandable", "Twenty-third session: the version table (0.16.1, TE on)",
     "Twenty-second session: ... on one H100 80 GB (kernel trial)", (4, 65536), (4, 131072), 1.77, 5.93,
     ["actor.loss.lm_head_loss_chunk_size=2048"]),
    ("H100, TE, Qwen3-30B-A3B, chunk 2048 + expandable", "Twenty-second session: ... on one H100 80 GB (kernel trial)",
     "Twenty-third session: the version table (0.16.1, TE on)", (4, 131072), (4, 65536), 5.93, 1.77,
     ["actor.loss.lm_head_loss_chunk_size=2048"]),
    ("H100, TE hidden, fp32 Adam, megatron-core 0.19.2", "Twenty-second session: megatron-core 0.19.2 on the H100",
     "Twenty-third session: the version table (0.19.2, hidden)", (4, 16384), (4, 65536), 0.301, 1.71,
     ["actor.loss.lm_head_loss_chunk_size=2048", "actor.megatron.use_precision_aware_optimizer=false",
      "actor.megatron.main_grads_dtype=float32",
      "actor.megatron.transformer_impl=local"]),
]
# The H200 TE pair: the fixture trace's run (sixteenth session, "the first TE runs", 2 layers, 8192 tokens, kernel
# step 2 0.325 s) and the 4-layer 131072-token slice of the same session ("Sixteenth session's last calls": kernel
# step 2 6.10 s; parts from compare_local_vs_te as quoted there) and of the twentieth session (5.919 s, after the fused
# SwiGLU; parts from docs/examples/qwen3_30b_a3b/kernel/profile_summary.md).
MEASURED_131072 = {
    "sixteenth": {"step": 6097.0, "gpu_busy": 5558.0, "idle": 538.7, "attn_core": 4424.0, "experts": 418.0,
                  "dispatch_combine": 118.0, "router": 60.0, "optimizer": 45.0},
    "twentieth": {"step": 5919.075, "gpu_busy": 5704.9, "idle": 214.2, "attn_qkv": 63.559, "attn_core": 4638.396,
                  "attn_out": 50.004, "attn_other": 27.890, "norm": 19.498, "router": 61.393,
                  "dispatch_combine": 119.540, "experts": 315.151, "layer_other": 5.830, "embedding": 2.421,
                  "lm_head_loss": 389.980, "optimizer": 44.355, "outside_parts": 15.876},
}


def _pct(projected: float, measured: float) -> str:
    return f"{100 * (projected - measured) / measured:+.1f}"


def step_pairs() -> None:
    print("| pair | source run (NOTES) | target run (NOTES) | measured s | projected s (at the measured FLOP rate) | "
          "measured target s | error % |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, src_where, dst_where, (l0, t0), (l1, t1), s0, s1, args in STEP_PAIRS:
            cfg = dataclasses.asdict(load_config(str(ROOT / "qwen3_30b_a3b_sft_profile.yaml"), SLICE + args + [
                f"actor.num_layers={l0}", f"profile.fake_seq_len={t0}", f"cluster.fileroot={tmp}"]))
            a, b = rank_slice(cfg, l0, t0, 0), rank_slice(cfg, l1, t1, 0)
            projected = s0 * (b.model_flops + b.recompute_flops) / (a.model_flops + a.recompute_flops)
            print(f"| {name}: {l0} layers x {t0} -> {l1} x {t1} | {src_where} | {dst_where} | {s0:.3f} | "
                  f"{projected:.3f} | {s1:.3f} | {_pct(projected, s1)} |")


def part_pair() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        summary = postprocessed_trial(Path(tmp), "kernel", 2, FIXTURE_DIR / "h200_te_kernel.trace.json.gz",
                                      ["profile.fake_seq_len=8192"] + SLICE[2:], te=True)
    p = project_slice(summary, 4, 131072)
    parts: dict[str, list[float]] = {}
    for r in p["rows"]:
        cell = parts.setdefault(r["part"], [0.0, 0.0])
        cell[0] += r["measured_ms"]
        cell[1] += r["projected_ms"]
    src = p["source"]
    rows = [(part, m, pr) for part, (m, pr) in parts.items()] + [
        ("gpu_busy", src["gpu_busy_ms"], p["gpu_busy_ms"]), ("idle", src["idle_ms"], p["idle_ms"]),
        ("step", src["step_ms"], p["projected_step_ms"])]
    print("\n| H200 TE, 2 layers x 8192 -> 4 x 131072 | measured at 8192 ms | projected ms | sixteenth session ms | "
          "error % | twentieth session ms | error % |")
    print("|---|---|---|---|---|---|---|")
    for part, m, pr in rows:
        cells = []
        for run in ("sixteenth", "twentieth"):
            ref = MEASURED_131072[run].get(part)
            cells += [f"{ref:.1f}", _pct(pr, ref)] if ref else ["–", "–"]
        print(f"| {part} | {m:.1f} | {pr:.1f} | " + " | ".join(cells) + " |")
    for what, value in (("GPU-bound step", p["gpu_bound_step_ms"]), ("step at the measured FLOP rate",
                                                                   p["constant_rate_step_ms"])):
        print(f"| {what} | – | {value:.1f} | {MEASURED_131072['sixteenth']['step']:.1f} | "
              f"{_pct(value, MEASURED_131072['sixteenth']['step'])} | {MEASURED_131072['twentieth']['step']:.1f} | "
              f"{_pct(value, MEASURED_131072['twentieth']['step'])} |")
    m = p["memory"]
    print(f"\nmemory at 4 x 131072 (fit check): predicted peak {m['peak_gib']:.2f} GiB in the {m['phase']}")


def simulated_pairs() -> None:
    """The shipped layout's rank 0 simulated at 4, 8 and 16 layers (H100, TE hidden; tests/fixtures/README.md): each
    smaller trial projected part by part to each deeper one, against the deeper trial's step 2 (the profiled step)
    and step 1 (the summary's stats), its own projected step with communication, and its peak."""
    def summary(layers: int) -> dict:
        with gzip.open(FIXTURE_DIR / "h100_simulated_rank0" / f"L{layers}.profile_summary.json.gz", "rt") as f:
            return json.load(f)

    print("\n| H100 TE hidden, rank 0 of megatron:(attn:d2c4\\|ffn:d1e8) simulated | projected compute ms | measured "
          "step 2 ms | error % | step 1 ms | error % | projected step with communication ms / measured trial's | "
          "error % | fit check / measured peak GiB | error % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for l0, l1 in ((4, 8), (4, 16), (8, 16)):
        p, m = project_slice(summary(l0), l1), summary(l1)
        step2, own = m["simulation"]["projection"]["compute_ms"], m["simulation"]["projection"]["projected_step_ms"]
        step1 = 1000 * next(r["step_time_s"] for r in m["stats"]["steps"] if r["step"] == 1)
        comm = p["communication"]["projected_step_ms"]
        peak, predicted = m["stats"]["max_mem_peak_allocated_gb"], p["memory"]["peak_gib"]
        print(f"| {l0} -> {l1} layers | {p['projected_step_ms']:.1f} | {step2:.1f} | "
              f"{_pct(p['projected_step_ms'], step2)} | {step1:.1f} | {_pct(p['projected_step_ms'], step1)} | "
              f"{comm:.1f} / {own:.1f} | {_pct(comm, own)} | {predicted:.2f} / {peak:.2f} | {_pct(predicted, peak)} |")


if __name__ == "__main__":
    step_pairs()
    part_pair()
    simulated_pairs()
