"""Train three optimizer steps of the shipped YAML's settings, and of each variation of them, with Transformer Engine
and without, and print one table side by side.

``--nproc 1`` runs the ``megatron:d1`` cases, ``--nproc 2`` the two-GPU layouts (``(attn:c2|ffn:e2)``,
``(attn:t2|ffn:e2)``, ``d2``, ``p2``); each case runs in its own ``torchrun`` (a fresh CUDA context, so its
peak memory is its own), ``--per-gpu`` of them sharing each GPU (group) of the visible GPUs::

    python bench/settings_matrix.py --nproc 1 --checkpoint /tmp/q3_2l --out m1.json   # writes the checkpoint first
    python bench/settings_matrix.py --nproc 2 --checkpoint /tmp/q3_2l --out m2.json

Model: Qwen3-30B-A3B cut to ``--layers`` (2) at ``--seq`` (8192) tokens, loaded from a random bf16 Hugging
Face checkpoint (written with :func:`sftprof.models.hf.save_random_checkpoint` when missing) so that every
case and every layout starts from the same weights; the Qwen3.5 case (``qwen3_5 gated delta-net``) runs the
Qwen3.5 YAML cut to 4 layers (three gated delta-net layers, one full-attention layer), random init.

``--te``: ``te`` runs each case with Transformer Engine (``actor.megatron.transformer_impl=transformer_engine``) on the
shipped YAML's own settings (precision-aware optimizer, bf16 main grads: TE's FusedAdam); ``local`` runs it with
TE hidden (``actor.megatron.transformer_impl=local``: local specs, torch Adam), where the precision-aware optimizer
cannot run, so with ``USE_PRECISION_AWARE_OPTIMIZER=false MAIN_GRADS_DTYPE=float32``. Default: both when TE
imports here, else ``local``. Each case changes one thing (see :data:`CASES`; ``fp32 main grads`` only with TE,
since it is the local base). A case that raises is recorded with its error and the matrix goes on.

Output: one table (per case, each TE mode side by side: losses of steps 0 and 2, step-0 grad norm, time of the
last step, peak GiB) and, with ``--out``, JSON with one row per (case, mode); ``tests/test_settings_matrix_gpu.py``
asserts on it. ``--rows A.json B.json`` prints the table of rows written by earlier runs (e.g. ``--te te`` and
``--te local`` run apart), and with ``--out`` writes them merged; it runs nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
YAML = REPO / "qwen3_30b_a3b_sft_profile.yaml"
YAML_QWEN3_5 = REPO / "qwen3_5_35b_a3b_sft_profile.yaml"
FP32_OPTIMIZER = ["actor.megatron.use_precision_aware_optimizer=false", "actor.megatron.main_grads_dtype=float32",
                  "actor.megatron.main_params_dtype=float32", "actor.megatron.exp_avg_dtype=float32",
                  "actor.megatron.exp_avg_sq_dtype=float32"]
# mode -> overrides on top of the YAML: "te" keeps the shipped precision settings, "local" cannot (module docstring)
MODES = {"te": ["actor.megatron.transformer_impl=transformer_engine"],
         "local": ["actor.megatron.transformer_impl=local"] + FP32_OPTIMIZER}
ONE_GPU = "megatron:d1"
QWEN3_5 = "qwen3_5 gated delta-net"
# name -> (layout, overrides on top of the mode's base); "base" cases are the shipped settings on that layout.
CASES = {
    "base": (ONE_GPU, []),
    "overlap_param_gather=false": (ONE_GPU, ["actor.megatron.ddp.overlap_param_gather=false"]),
    "overlap_grad_reduce=false": (ONE_GPU, ["actor.megatron.ddp.overlap_grad_reduce=false"]),
    "both overlaps false": (ONE_GPU, ["actor.megatron.ddp.overlap_param_gather=false",
                                      "actor.megatron.ddp.overlap_grad_reduce=false"]),
    "lm_head_loss_chunk_size=2048": (ONE_GPU, ["actor.loss.lm_head_loss_chunk_size=2048"]),
    "logprobs_chunk_size=0": (ONE_GPU, ["actor.loss.logprobs_chunk_size=0"]),
    "recompute selective": (ONE_GPU, ["actor.megatron.recompute_granularity=selective",
                                      "actor.megatron.recompute_modules=[core_attn,layernorm,moe]"]),
    "recompute none": (ONE_GPU, ["actor.megatron.recompute_granularity=none"]),
    "deterministic": (ONE_GPU, ["actor.megatron.use_deterministic_algorithms=true"]),
    "n_mbs=1": (ONE_GPU, ["actor.mb_spec.n_mbs=1"]),
    "fp32 main grads": (ONE_GPU, FP32_OPTIMIZER),
    QWEN3_5: (ONE_GPU, ["actor.num_layers=4", "actor.init_from_scratch=true"]),
    "c2e2 base": ("megatron:(attn:c2|ffn:e2)", []),
    "c2e2 lm_head 2048": ("megatron:(attn:c2|ffn:e2)", ["actor.loss.lm_head_loss_chunk_size=2048"]),
    "t2e2 base": ("megatron:(attn:t2|ffn:e2)", []),
    "t2e2 lm_head 2048": ("megatron:(attn:t2|ffn:e2)", ["actor.loss.lm_head_loss_chunk_size=2048"]),
    "d2 base": ("megatron:d2", []),
    "d2 lm_head 2048": ("megatron:d2", ["actor.loss.lm_head_loss_chunk_size=2048"]),
    "p2 base": ("megatron:p2", []),
    "p2 lm_head 2048": ("megatron:p2", ["actor.loss.lm_head_loss_chunk_size=2048"]),
}
TE_ONLY = {"fp32 main grads"}


def case_overrides(name: str, mode: str, checkpoint: Path, seq: int) -> tuple[Path, list]:
    """``(yaml, overrides)`` of one case in one TE mode (module docstring)."""
    layout, extra = CASES[name]
    if name == QWEN3_5:
        return YAML_QWEN3_5, MODES[mode] + [f"actor.backend={layout}", f"profile.fake_seq_len={seq}"] + extra
    return YAML, MODES[mode] + ["actor.init_from_scratch=false", f"actor.backend={layout}", f"actor.path={checkpoint}",
                                f"profile.fake_seq_len={seq}"] + extra


def ensure_checkpoint(path: Path, layers: int) -> None:
    """Write a random bf16 Qwen3-30B-A3B checkpoint cut to ``layers`` unless ``path`` has one."""
    from sftprof.models.hf import load_hf_config, save_random_checkpoint

    if not (path / "model.safetensors.index.json").is_file():
        save_random_checkpoint(load_hf_config("qwen3_30b_a3b", layers), path, torch.bfloat16, seed=0, device="cuda")


def run_case(name: str, mode: str, args) -> dict:
    """Build the engine of one case in one TE mode, train ``args.steps`` steps, return losses, grad norms, time
    and peak."""
    from megatron.core import parallel_state

    from sftprof.allocation import parse_allocation_mode
    from sftprof.config import load_config
    from sftprof.data import global_loss_tokens, make_fake_sample, step_micro_batches
    from sftprof.engine.megatron import MegatronEngine
    from sftprof.models.hf import load_hf_config
    from sftprof.tokenizer import load_tokenizer

    row = {"case": name, "mode": mode, "layout": CASES[name][0], "loss": [], "grad_norm": []}
    engine = None
    try:
        yaml, overrides = case_overrides(name, mode, args.checkpoint, args.seq)
        cfg = load_config(str(yaml), overrides)
        layout = parse_allocation_mode(cfg.actor.backend)
        hf = load_hf_config(cfg.actor.path, cfg.actor.num_layers)  # the Qwen3.5 case cuts its 40 layers to 4
        sample = make_fake_sample(load_tokenizer("", cfg.actor.path, hf.model_type), args.seq,
                                  cfg.profile.fake_loss_start_ratio, hf.vocab_size)
        tokens = global_loss_tokens(sample, cfg.train_dataset.batch_size)
        dp_rank = layout.rank_coords(dist.get_rank())["dp"]
        torch.cuda.reset_peak_memory_stats()
        engine = MegatronEngine(cfg, layout, hf, torch.device("cuda", torch.cuda.current_device()))
        for step in range(args.steps):
            mbs = step_micro_batches(cfg, sample, step, layout.dp, dp_rank)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = engine.train_step(mbs, tokens)
            torch.cuda.synchronize()
            row["step_s"] = time.perf_counter() - t0
            row["loss"].append(result.loss)
            row["grad_norm"].append(result.grad_norm)
        row["moe_max_over_mean"] = result.moe_load["max_over_mean_max"]
        row["peak_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
        row["ok"] = all(math.isfinite(x) for x in row["loss"] + row["grad_norm"])
    except Exception as err:  # recorded; the matrix goes on with the next case
        row.update(ok=False, error=f"{type(err).__name__}: {err}"[:400], traceback=traceback.format_exc()[-2000:])
    finally:
        del engine
        parallel_state.destroy_model_parallel()
    return row


def _case_main(name: str, args) -> int:
    """One case under torchrun: train it and print ``RESULT <json>`` on rank 0."""
    from sftprof.compat import setup_transformer_engine
    from sftprof.config import load_config
    from sftprof.trainer import init_distributed

    yaml, overrides = case_overrides(name, args.mode, args.checkpoint, args.seq)
    setup_transformer_engine(load_config(str(yaml), overrides).actor.megatron.transformer_impl)  # before megatron
    init_distributed()
    row = run_case(name, args.mode, args)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


def _run_pool(names: list, slots: list, args) -> list:
    """Run each case in its own ``torchrun``, one per slot (a slot is a comma list of GPUs; a GPU group may
    appear in several slots, so cases share it), starting the next case when a slot frees up. Output goes
    to files named by case in a printed temporary folder (pipes of concurrent children would fill and block);
    returns the rows in ``names`` order."""
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="settings_matrix_"))
    print(f"each case's stdout/stderr: {logs}/<case>.out.log, .err.log", flush=True)
    pending, running, rows = list(names), {}, {}
    try:
        _pool_loop(pending, running, rows, slots, logs, args)
    finally:  # an interrupted matrix leaves no case running
        for key, proc, *_ in running.values():
            _kill_case(proc)
    return [rows[n] for n in names]


def _die_with_parent() -> None:
    """``preexec_fn`` of a case: Linux sends the case's torchrun SIGTERM when this script dies (even by SIGKILL,
    e.g. a test's timeout), and torchrun stops its workers."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_case(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _pool_loop(pending: list, running: dict, rows: dict, slots: list, logs: Path, args) -> None:
    while pending or running:
        for slot, gpus in enumerate(slots):
            if slot in running or not pending:
                continue
            name, mode = key = pending.pop(0)
            out, err = (open(logs / f"{name}.{mode}.{i}.log", "w+") for i in ("out", "err"))
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                 f"--master_port={29751 + slot}", __file__, "--case", name, "--mode", mode,
                 "--checkpoint", str(args.checkpoint), "--seq", str(args.seq), "--steps", str(args.steps)],
                env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpus), stdout=out, stderr=err, text=True,
                start_new_session=True, preexec_fn=_die_with_parent)
            running[slot] = (key, proc, out, err, time.monotonic())
        time.sleep(1.0)
        for slot, (key, proc, out, err, started) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started > args.case_timeout:
                _kill_case(proc)
                err.write(f"\nsettings_matrix: case stopped after --case-timeout {args.case_timeout:g} s\n")
            if proc.poll() is None:
                continue
            del running[slot]
            out.seek(0)
            err.seek(0)
            found = [ln[len("RESULT "):] for ln in out.read().splitlines() if ln.startswith("RESULT ")]
            stderr = err.read()
            rows[key] = json.loads(found[-1]) if found else {
                "case": key[0], "mode": key[1], "layout": CASES[key[0]][0], "ok": False, "loss": [], "grad_norm": [],
                "error": f"exit {proc.returncode}: " + (stderr.strip().splitlines() or ["no output"])[-1][:300]}
            print("ROW " + json.dumps({k: v for k, v in rows[key].items() if k != "traceback"}), flush=True)
            out.close()
            err.close()


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if not r["ok"]:
        return "FAILED: " + (r.get("error") or "non-finite values")[:60]
    return (f"{r['loss'][0]:.5f}/{r['loss'][-1]:.5f} {r['grad_norm'][0]:.4f} {r['step_s']:.3f}s "
            f"{r['peak_gib_rank0']:.1f}GiB")


def print_table(rows: list, modes: list) -> None:
    """One line per case, the TE modes side by side: losses of the first and last step, step-0 grad norm, time of
    the last step, peak GiB on rank 0."""
    by = {(r["case"], r["mode"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print(f"\n{'case':<30} {'layout':<26} " + " ".join(f"{m + ': loss s0/last gnorm0 last-step peak':<52}" for m in modes))
    for c in cases:
        layout = next(r.get("layout", "") for r in rows if r["case"] == c)
        print(f"{c:<30} {layout:<26} " + " ".join(f"{_cell(by.get((c, m))):<52}" for m in modes))


ROW_KEYS = ("case", "mode", "ok", "loss", "grad_norm")


def load_rows(paths: list) -> list:
    """The rows of ``--out`` files, in order (a later file's row replaces an earlier one of the same case and mode).

    Raises:
        ValueError: a file that cannot be read, is not a JSON list of rows, or has a row without one of
            :data:`ROW_KEYS` or with a mode not in :data:`MODES`; the message names the file.
    """
    rows = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: {type(err).__name__}: {err}") from None
        if not isinstance(data, list) or not data:
            raise ValueError(f"{path}: not a non-empty JSON list of rows (settings_matrix.py --out writes one)")
        for i, r in enumerate(data):
            missing = [k for k in ROW_KEYS if not isinstance(r, dict) or k not in r]
            if missing or r["mode"] not in MODES:
                raise ValueError(f"{path}: row {i}: " + (f"missing {missing}" if missing else
                                                         f"mode {r['mode']!r} not one of {list(MODES)}"))
            rows[(r["case"], r["mode"])] = r
    return list(rows.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, help="HF checkpoint dir (written when missing); required unless --rows")
    ap.add_argument("--rows", type=Path, nargs="+", help="print the table of these --out files and exit")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs: runs the cases whose layout has this world size")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", default="", help="comma list of case names (default: all of this world size)")
    ap.add_argument("--te", default="", help="comma list of te,local (default: te,local when transformer_engine "
                                             "imports here, else local)")
    ap.add_argument("--out", type=Path, help="JSON output")
    ap.add_argument("--case-timeout", type=float, default=900.0,
                    help="seconds after which a case's torchrun is stopped and the case recorded as failed")
    ap.add_argument("--per-gpu", type=int, default=0,
                    help="cases that share one GPU (group) at a time; 0 (default): one per 60 GiB of the first "
                         "GPU's memory (2 layers, 8192 tokens; step times then include the neighbours' load)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case per torchrun
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: its TE mode
    args = ap.parse_args()
    if args.rows:
        extra = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k not in ("rows", "out") and v != ap.get_default(k)]
        if extra:
            ap.error(f"--rows prints saved rows and takes only --out (the merged rows); also given: {extra}")
        try:
            rows = load_rows(args.rows)
        except ValueError as err:
            ap.error(f"--rows {err}")
        print_table(rows, [m for m in MODES if any(r["mode"] == m for r in rows)])
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
        return 0 if all(r["ok"] for r in rows) else 1
    if args.checkpoint is None:
        ap.error("--checkpoint is required (unless --rows)")
    if args.nproc < 1 or args.per_gpu < 0:  # --per-gpu < 0 left the pool no slot: it waited forever
        ap.error(f"--nproc {args.nproc} must be >= 1 and --per-gpu {args.per_gpu} >= 0 (0: from the GPU's memory)")
    modes = [m for m in args.te.split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"--te {args.te}: accepted: a comma list of {list(MODES)}")
    if not torch.cuda.is_available():
        print("needs CUDA GPUs", file=sys.stderr)
        return 2
    if args.case:
        return _case_main(args.case, args)
    from sftprof.allocation import parse_allocation_mode
    from sftprof.models.specs import have_transformer_engine

    modes = modes or (["te", "local"] if have_transformer_engine() else ["local"])
    wanted = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        print(f"--cases: unknown {unknown}; accepted: {list(CASES)}", file=sys.stderr)
        return 2
    ensure_checkpoint(args.checkpoint, args.layers)
    names = [(n, m) for m in modes for n in wanted if parse_allocation_mode(CASES[n][0]).world_size == args.nproc
             and (m == "te" or n not in TE_ONLY)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    groups = [",".join(devices[g * args.nproc:(g + 1) * args.nproc]) for g in range(len(devices) // args.nproc)]
    if not groups:
        print(f"--nproc {args.nproc}: only {len(devices)} GPU(s) visible", file=sys.stderr)
        return 2
    # a one-GPU case reserves ~50 GiB (42 GiB allocated); 3 of them ran out of memory on a 139.8 GiB H200
    per_gpu = args.per_gpu or max(1, int(torch.cuda.get_device_properties(0).total_memory / 2**30 // 60))
    print(f"{len(names)} cases ({', '.join(modes)}), {per_gpu} per GPU group of {groups}", flush=True)
    rows = _run_pool(names, [g for _ in range(per_gpu) for g in groups], args)
    print_table(rows, modes)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
