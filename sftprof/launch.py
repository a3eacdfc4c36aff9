"""Driver planning: environment variables -> validated trials (one per profile step and kind).

``run_qwen3_30b_a3b_sft_profile.sh`` calls ``python -m sftprof.launch plan`` once before launching
anything. It validates every environment variable and the config they produce, resolves the
profiled ranks, refuses an existing non-empty ``RUN_ROOT``, and writes:

- ``RUN_ROOT/profile_settings.log``: every driver variable with its effective value and source,
  the torchrun layout, and the resolved config of the first trial;
- ``RUN_ROOT/trials.tsv``: one row per trial (step-major, kernel before memory):
  ``trial_name, kind, step, run_dir, log_dir, args_file``;
- ``RUN_ROOT/<trial>/train_args.txt``: the trainer's arguments, one per line.

Variables that map to a config key override the YAML only when they are set, so the shipped YAML
carries the seed defaults (``qwen3_30b_a3b_sft_profile.yaml``: 131072 tokens, batch 4, 2
micro-batches, logprobs chunk 128, precision-aware optimizer with bf16 main grads) and a preset
such as ``CONFIG=tiny_cpu`` keeps its own sizes. Any bad value exits 2 with a message naming the
variable, the value and what is accepted.

``python -m sftprof.launch status LOG_DIR`` prints ``0`` when the trial's ``stats.jsonl`` ends
with a completion record of status ``ok`` and ``1`` otherwise (the driver reads success from it).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from sftprof.allocation import parse_allocation_mode
from sftprof.config import ConfigError, load_config, to_yaml, trial_log_dir
from sftprof.models.hf import ModelPathError, load_hf_config
from sftprof.ranks import RankSpecError, format_ranks, resolve_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "qwen3_30b_a3b_sft_profile.yaml"
KINDS = ("kernel", "memory")
BOOL_TEXT = {"true": True, "false": False, "1": True, "0": False}
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class DriverError(ValueError):
    """A driver environment variable is invalid (message names it, its value and what is accepted)."""


def _int(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum or text.strip().startswith("+"):
        raise DriverError(f"{name}={text!r}: must be an integer >= {minimum}")
    return value


def _float_ratio(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:
        raise DriverError(f"{name}={text!r}: must be a number in [0, 1)")
    return value


def _bool(name: str, text: str) -> bool:
    if text.strip().lower() not in BOOL_TEXT:
        raise DriverError(f"{name}={text!r}: must be true or false (or 1/0)")
    return BOOL_TEXT[text.strip().lower()]


def _dtype(name: str, text: str) -> str:
    if text.strip().lower() not in DTYPE_ALIASES:
        raise DriverError(f"{name}={text!r}: must be one of float32, bfloat16 (aliases fp32, bf16)")
    return DTYPE_ALIASES[text.strip().lower()]


def _no_repeats(name: str, text: str, items: list) -> None:
    repeated = sorted({str(t) for t in items if items.count(t) > 1})
    if repeated:
        raise DriverError(f"{name}={text!r}: lists {','.join(repeated)} more than once; each trial runs once")


def _int_list(name: str, text: str) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t.isdigit() for t in items):
        raise DriverError(f"{name}={text!r}: must be a comma-separated list of non-negative integers, e.g. 0,1")
    _no_repeats(name, text, [int(t) for t in items])
    return sorted(int(t) for t in items)


def _kinds(name: str, text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in KINDS]
    if not text.strip() or bad:
        raise DriverError(f"{name}={text!r}: must be a non-empty comma-separated subset of {','.join(KINDS)}"
                          + (f" (unknown: {','.join(bad)})" if text.strip() and bad else ""))
    _no_repeats(name, text, items)
    return [k for k in KINDS if k in items]


def _host(name: str, text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:\[\]-]+", text):
        raise DriverError(f"{name}={text!r}: must be a host name or IP address (letters, digits, '.', '-', ':', '[]')")
    return text


@dataclass(frozen=True)
class ConfigVar:
    """A driver variable that overrides one config key (only when set)."""

    name: str
    key: str
    parse: Callable[[str, str], object]


CONFIG_VARS = (
    ConfigVar("MODEL_PATH", "actor.path", lambda n, t: t),
    ConfigVar("FILEROOT", "cluster.fileroot", lambda n, t: str(Path(t).expanduser().resolve())),
    ConfigVar("EXPERIMENT_NAME", "experiment_name", lambda n, t: t),
    ConfigVar("PROFILE_FAKE_SEQ_LEN", "profile.fake_seq_len", lambda n, t: _int(n, t, 2)),
    ConfigVar("PROFILE_FAKE_DATASET_SIZE", "profile.fake_dataset_size", lambda n, t: _int(n, t, 1)),
    ConfigVar("PROFILE_FAKE_LOSS_START_RATIO", "profile.fake_loss_start_ratio", _float_ratio),
    ConfigVar("TRAIN_BATCH_SIZE", "train_dataset.batch_size", lambda n, t: _int(n, t, 1)),
    ConfigVar("PROFILE_N_MBS", "actor.mb_spec.n_mbs", lambda n, t: _int(n, t, 1)),
    ConfigVar("MEMORY_MAX_ENTRIES", "memory_profiler.max_entries", lambda n, t: _int(n, t, 1)),
    ConfigVar("LOGPROBS_CHUNK_SIZE", "actor.logprobs_chunk_size", lambda n, t: _int(n, t, 0)),
    ConfigVar("LM_HEAD_LOSS_CHUNK_SIZE", "actor.megatron.lm_head_loss_chunk_size", lambda n, t: _int(n, t, 0)),
    ConfigVar("USE_PRECISION_AWARE_OPTIMIZER", "actor.megatron.use_precision_aware_optimizer", _bool),
    ConfigVar("MAIN_GRADS_DTYPE", "actor.megatron.main_grads_dtype", _dtype),
    ConfigVar("USE_DETERMINISTIC_ALGORITHMS", "actor.megatron.use_deterministic_algorithms", _bool),
)
PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _yaml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class Trial:
    """One torchrun launch: profile ``kind`` at ``step`` (paths absolute)."""

    name: str
    kind: str
    step: int
    run_dir: Path
    log_dir: Path
    args: list[str]


def seq_tag(n_tokens: int) -> str:
    """``131072`` -> ``"128k"``; lengths that are not a multiple of 1024 stay numeric."""
    return f"{n_tokens // 1024}k" if n_tokens % 1024 == 0 else str(n_tokens)


def plan(env: Mapping[str, str], extra_overrides: list[str]) -> tuple[list[Trial], list[str], dict]:
    """Validate the driver environment and return ``(trials, settings_lines, torchrun)``.

    ``torchrun`` holds ``nproc_per_node, nnodes, node_rank, master_addr, master_port``.

    Raises:
        DriverError: a variable is invalid, the config they produce is invalid, the torchrun
            world size does not match the allocation mode, or RUN_ROOT exists and is not empty.
    """
    get = env.get
    settings: list[str] = []

    def note(name: str, value: object, source: str) -> None:
        settings.append(f"{name}={value}\t# {source}")

    config = get("CONFIG") or str(REPO_ROOT / DEFAULT_CONFIG)
    note("CONFIG", config, "env" if get("CONFIG") else "default")
    steps = _int_list("PROFILE_STEPS", get("PROFILE_STEPS") if get("PROFILE_STEPS") is not None else "0,1")
    kinds = _kinds("PROFILE_KINDS", get("PROFILE_KINDS") if get("PROFILE_KINDS") is not None else "kernel,memory")
    total_steps = _int("TOTAL_STEPS", get("TOTAL_STEPS"), 1) if get("TOTAL_STEPS") else None
    if total_steps is not None and total_steps <= max(steps):
        raise DriverError(f"TOTAL_STEPS={total_steps}: must be > the largest profile step {max(steps)} "
                          "(or unset: profile step + 1)")
    stop = _bool("STOP_ON_FAILURE", get("STOP_ON_FAILURE") if get("STOP_ON_FAILURE") is not None else "1")
    note("PROFILE_STEPS", ",".join(map(str, steps)), "env" if get("PROFILE_STEPS") is not None else "default")
    note("PROFILE_KINDS", ",".join(kinds), "env" if get("PROFILE_KINDS") is not None else "default")
    note("TOTAL_STEPS", total_steps if total_steps else "profile_step+1", "env" if total_steps else "default")
    note("STOP_ON_FAILURE", int(stop), "env" if get("STOP_ON_FAILURE") is not None else "default")

    overrides: list[str] = []
    set_keys: set[str] = set()
    for var in CONFIG_VARS:
        text = get(var.name)
        if not text:  # unset or empty: the config's value stands
            continue
        value = var.parse(var.name, text)
        # Text values go in as JSON strings, so YAML never reads "0123", "yes" or "a #b" as something else.
        overrides.append(f"{var.key}={json.dumps(value) if isinstance(value, str) else _yaml_value(value)}")
        set_keys.add(var.name)
    n_nodes = _int("N_NODES", get("N_NODES"), 1) if get("N_NODES") else None
    node_rank = _int("NODE_RANK", get("NODE_RANK") or "0", 0)
    master_port = _int("MASTER_PORT", get("MASTER_PORT") or "29500", 1)
    if master_port > 65535:
        raise DriverError(f"MASTER_PORT={master_port}: must be in [1, 65535]")
    nproc = _int("N_GPUS_PER_NODE", get("N_GPUS_PER_NODE"), 1) if get("N_GPUS_PER_NODE") else None

    if "USE_PRECISION_AWARE_OPTIMIZER" in set_keys and not _bool("", get("USE_PRECISION_AWARE_OPTIMIZER")) \
            and "MAIN_GRADS_DTYPE" not in set_keys:
        # USE_PRECISION_AWARE_OPTIMIZER=false alone: the optimizer dtypes follow it back to float32.
        overrides += [f"actor.megatron.{f}=float32" for f in PRECISION_FIELDS]
        settings.append("# USE_PRECISION_AWARE_OPTIMIZER=false: main grads, main params and Adam moments set to float32")
    try:
        probe = load_config(config, overrides + extra_overrides)
    except ConfigError as err:
        raise DriverError(f"{err} (from CONFIG={config} and the driver variables)") from err
    try:
        hf_config = load_hf_config(probe.actor.path, probe.actor.num_layers)
    except (ModelPathError, ValueError) as err:
        raise DriverError(f"{err} (MODEL_PATH / actor.path)") from err
    if parse_allocation_mode(probe.actor.backend).backend == "megatron":
        from sftprof.models.megatron_config import check_model_settings
        try:
            check_model_settings(probe, hf_config, parse_allocation_mode(probe.actor.backend))
        except ConfigError as err:
            raise DriverError(f"{err} (from CONFIG={config} and the driver variables)") from err
    if probe.tokenizer_path and not Path(probe.tokenizer_path).expanduser().is_dir():
        raise DriverError(f"tokenizer_path={probe.tokenizer_path!r}: not a directory; accepted: a Hugging Face "
                          "tokenizer directory, or empty for the model's tokenizer / the bundled Qwen3 BPE")
    layout = parse_allocation_mode(probe.actor.backend)
    n_nodes = n_nodes or probe.cluster.n_nodes
    if node_rank >= n_nodes:
        raise DriverError(f"NODE_RANK={node_rank}: must be in [0, N_NODES={n_nodes})")
    if nproc is None:
        nproc = layout.world_size // n_nodes
    if nproc * n_nodes != layout.world_size:
        raise DriverError(
            f"N_GPUS_PER_NODE={nproc} x N_NODES={n_nodes} = {nproc * n_nodes} processes, but actor.backend="
            f"{probe.actor.backend!r} needs world size {layout.world_size}")
    overrides += [f"cluster.n_nodes={n_nodes}", f"cluster.n_gpus_per_node={nproc}"]
    ranks_env = get("PROFILE_RANKS")
    ranks_spec = "pp_rank0" if ranks_env is None else ranks_env.strip()
    try:
        ranks = resolve_ranks(ranks_spec, layout)
    except RankSpecError as err:
        raise DriverError(f"PROFILE_RANKS={ranks_env!r}: {err} (actor.backend={probe.actor.backend})") from err
    overrides += [f"perf_tracer.ranks='{ranks_spec}'", f"memory_profiler.ranks='{ranks_spec}'"]
    for var in CONFIG_VARS:
        node = probe
        for part in var.key.split("."):
            node = getattr(node, part)
        note(var.name, _yaml_value(node), f"env -> {var.key}" if var.name in set_keys else f"config {var.key}")
    note("PROFILE_RANKS", format_ranks(ranks) if ranks_spec else "all", "env" if ranks_env is not None else "default pp_rank0")
    note("N_GPUS_PER_NODE", nproc, "env" if get("N_GPUS_PER_NODE") else f"world size {layout.world_size} / N_NODES")
    note("N_NODES", n_nodes, "env" if get("N_NODES") else "config cluster.n_nodes")
    if extra_overrides:
        settings.append(f"# extra overrides: {' '.join(extra_overrides)}")
    settings.append(f"# layout {probe.actor.backend}: {layout.describe()}")

    if n_nodes > 1 and not get("PROFILE_STAMP"):
        raise DriverError(f"PROFILE_STAMP is unset with N_NODES={n_nodes}: set the same PROFILE_STAMP on every node "
                          "(trial names must match), and put FILEROOT on a filesystem all nodes share")
    stamp = get("PROFILE_STAMP") or _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    if not stamp.replace("_", "").replace("-", "").isalnum():
        raise DriverError(f"PROFILE_STAMP={stamp!r}: use letters, digits, '_' and '-' only")
    model_tag = Path(probe.actor.path.rstrip("/")).name.lower().replace("-", "_").replace(".", "_")
    run_root = Path(get("RUN_ROOT") or (Path.cwd() / "sftprof_runs" / f"{probe.experiment_name}_{stamp}")).expanduser().resolve()
    if run_root.exists() and (not run_root.is_dir() or any(run_root.iterdir())):
        raise DriverError(f"RUN_ROOT={run_root}: exists and is not empty; nothing was overwritten. "
                          "Choose another RUN_ROOT or PROFILE_STAMP")
    note("RUN_ROOT", run_root, "env" if get("RUN_ROOT") else "default ./sftprof_runs/<experiment>_<stamp>")
    note("PROFILE_STAMP", stamp, "env" if get("PROFILE_STAMP") else "default: now")

    trials, first_cfg = [], None
    for step in steps:
        for kind in kinds:
            name = f"{model_tag}_fake{seq_tag(probe.profile.fake_seq_len)}_{kind}_step{step}_{stamp}"
            trial_overrides = overrides + extra_overrides + [
                f"trial_name={name}",
                f"total_train_steps={total_steps or step + 1}",
                f"perf_tracer.enabled={'true' if kind == 'kernel' else 'false'}",
                f"perf_tracer.profile_steps=[{step}]" if kind == "kernel" else "perf_tracer.profile_steps=[]",
                f"memory_profiler.profile_steps=[{step}]" if kind == "memory" else "memory_profiler.profile_steps=[]",
            ]
            cfg = load_config(config, trial_overrides)
            first_cfg = first_cfg or cfg
            log_dir = trial_log_dir(cfg)
            if log_dir.exists() and any(log_dir.iterdir()):
                raise DriverError(f"trial log dir {log_dir} exists and is not empty (same EXPERIMENT_NAME and "
                                  "PROFILE_STAMP as an earlier run); choose another PROFILE_STAMP")
            trials.append(Trial(name, kind, step, run_root / name, log_dir,
                                ["--config", str(Path(config).resolve()) if Path(config).is_file() else config,
                                 *trial_overrides]))
    torchrun = {"nproc_per_node": nproc, "nnodes": n_nodes, "node_rank": node_rank,
                "master_addr": _host("MASTER_ADDR", get("MASTER_ADDR") or "127.0.0.1"), "master_port": master_port}
    settings.append("# torchrun " + " ".join(f"--{k}={v}" for k, v in torchrun.items()))
    settings.append("# resolved config of the first trial:")
    settings += ["#   " + line for line in to_yaml(first_cfg).splitlines()]
    return trials, settings, {"stop_on_failure": int(stop), "run_root": str(run_root), **torchrun}


def write_plan(trials: list[Trial], settings: list[str], info: dict) -> None:
    """Create RUN_ROOT with ``profile_settings.log``, ``trials.tsv`` and per-trial argument files."""
    run_root = Path(info["run_root"])
    run_root.mkdir(parents=True, exist_ok=True)
    (run_root / "profile_settings.log").write_text("\n".join(settings) + "\n")
    rows = []
    for t in trials:
        t.run_dir.mkdir(parents=True, exist_ok=False)
        args_file = t.run_dir / "train_args.txt"
        args_file.write_text("\n".join(t.args) + "\n")
        rows.append("\t".join([t.name, t.kind, str(t.step), str(t.run_dir), str(t.log_dir), str(args_file)]))
    (run_root / "trials.tsv").write_text("\n".join(rows) + "\n")


def trial_status(log_dir: Path) -> int:
    """0 if ``log_dir/stats.jsonl`` ends with ``{"type": "complete", "status": "ok"}``, else 1."""
    path = Path(log_dir) / "stats.jsonl"
    if not path.is_file():
        return 1
    last = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("type") == "complete":
            last = rec
    return 0 if last is not None and last.get("status") == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    """CLI: ``plan`` (exit 2 on bad input) or ``status LOG_DIR``; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m sftprof.launch", description="sftprof driver helper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_plan = sub.add_parser("plan", help="validate driver env vars and write RUN_ROOT's plan; prints shell variables")
    p_plan.add_argument("overrides", nargs="*", help="extra key=value config overrides for every trial")
    p_status = sub.add_parser("status", help="print 0 if the trial completed ok, else 1")
    p_status.add_argument("log_dir")
    args = ap.parse_args(argv)
    if args.cmd == "status":
        print(trial_status(Path(args.log_dir)))
        return 0
    try:
        trials, settings, info = plan(os.environ, args.overrides)
    except (DriverError, ConfigError) as err:
        print(f"sftprof: {err}", file=sys.stderr)
        return 2
    write_plan(trials, settings, info)
    for key, value in info.items():
        print(f"{key.upper()}={shlex.quote(str(value))}")  # the driver evals these lines
    return 0


if __name__ == "__main__":
    sys.exit(main())
