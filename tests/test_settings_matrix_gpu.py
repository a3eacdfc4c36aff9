"""GPU: every shipped setting, and each variation of it, trains three steps with Transformer Engine and without
(``bench/settings_matrix.py``).

One random bf16 Qwen3-30B-A3B checkpoint cut to 2 layers (8192 tokens per sequence) feeds every case, so
the cases start from the same weights:

- every case's three losses and grad norms are finite (no case crashes at step 1 or 2), in each TE mode (``te``:
  the shipped precision settings on TE; ``local``: TE hidden, fp32 optimizer);
- on one GPU, settings that change no arithmetic (overlap options, loss chunking, recompute, micro-batch
  count) give their mode's base case's step-0 loss within 1e-5 and grad norm within 1e-3 (relative), and its step-2
  loss within 1e-3; deterministic kernels (other bf16 kernels) and fp32 main grads within 1e-4 / 1e-2 / 1e-3;
- the TE base case's step-0 loss is the local one's within 2e-3 (the same weights; TE's and torch's bf16 kernels
  round differently);
- on two GPUs, each layout's step-0 loss is the one-GPU loss within 2e-3 (relative; TP and EP reduce bf16
  partial results in another order).

The whole one-GPU matrix (23 cases) takes ~10 minutes on one H200; ``SFTPROF_MATRIX_TE`` (``te``, ``local`` or
``te,local``) and ``SFTPROF_MATRIX_CASES`` (a comma list of case names; ``base`` is always added) run a part of it
(``python bench/settings_matrix.py --rows A.json B.json`` prints parts' rows as one table).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Cases that run other bf16 kernels than the base case: deterministic mode makes torch refuse kernels with a
# nondeterministic backward (cuDNN's SDPA among them; the step takes ~20 % longer), so their rounding differs:
# step-0 loss within 1e-4 and grad norm within 1e-2 (measured on 1x H200: 1.7e-5 and 5.7e-3). fp32 main grads
# change the gradient buffer's precision.
OTHER_KERNELS = {"deterministic", "fp32 main grads"}
OTHER_MODEL = {"qwen3_5 gated delta-net"}  # another model: trains, compared with nothing


def _wanted() -> tuple[list, list]:
    """The TE modes and one-GPU cases to run: ``SFTPROF_MATRIX_TE`` / ``SFTPROF_MATRIX_CASES`` (module docstring).
    An unknown mode or case fails the test, naming the variable and the accepted values, before any GPU work."""
    from sftprof.models.specs import have_transformer_engine

    matrix = _bench_module()
    one_gpu = _one_gpu_cases(matrix)
    raw_modes, raw_cases = (os.environ.get(k, "") for k in ("SFTPROF_MATRIX_TE", "SFTPROF_MATRIX_CASES"))
    modes = [m.strip() for m in raw_modes.split(",") if m.strip()]
    cases = [c.strip() for c in raw_cases.split(",") if c.strip()]
    if set(modes) - set(matrix.MODES):
        pytest.fail(f"SFTPROF_MATRIX_TE={raw_modes!r}: accepted: a comma list of {list(matrix.MODES)}")
    if set(cases) - set(one_gpu):
        pytest.fail(f"SFTPROF_MATRIX_CASES: unknown {sorted(set(cases) - set(one_gpu))}; accepted (a comma list of "
                    f"one-GPU cases): {one_gpu}")
    modes = modes or (["te", "local"] if have_transformer_engine() else ["local"])
    cases = ["base"] + [c for c in cases if c != "base"] if cases else one_gpu
    if "te" in modes and not have_transformer_engine():
        pytest.skip("SFTPROF_MATRIX_TE has te: needs transformer_engine")
    return modes, cases


def _one_gpu_cases(matrix) -> list:
    return [c for c, (layout, _) in matrix.CASES.items() if layout == matrix.ONE_GPU]


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("settings_matrix", REPO / "bench" / "settings_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    return matrix


def _matrix(nproc: int, ckpt: Path, out: Path, modes: list, cases: list | None = None) -> list:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(REPO / "bench" / "settings_matrix.py"), "--nproc", str(nproc), "--checkpoint", str(ckpt),
           "--out", str(out), "--te", ",".join(modes)] + (["--cases", ",".join(cases)] if cases else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-6000:])
    assert out.is_file(), f"settings_matrix.py exit {proc.returncode}, no rows: {proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())
    if os.environ.get("SFTPROF_GPU_OUT"):  # keep the rows for the run's record (e.g. the device's $OUT)
        shutil.copy(out, Path(os.environ["SFTPROF_GPU_OUT"]) / out.name)
    failed = [(r["case"], r.get("error"), r.get("traceback")) for r in rows if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rows


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    modes, cases = _wanted()
    tmp = tmp_path_factory.mktemp("matrix")
    whole = cases == _one_gpu_cases(_bench_module())
    part = "" if whole else "_" + hashlib.sha1(",".join(cases).encode()).hexdigest()[:8]
    out = tmp / f"m1_{'_'.join(modes)}{part}.json"  # parts of the matrix copied to one SFTPROF_GPU_OUT keep apart
    return tmp / "ckpt", modes, cases, _matrix(1, tmp / "ckpt", out, modes, cases)


@pytest.mark.gpu
def test_one_gpu_cases_train_and_agree(one_gpu):
    _, modes, cases, rows = one_gpu
    te_only = _bench_module().TE_ONLY  # "fp32 main grads" is the local mode's base
    assert sorted((r["case"], r["mode"]) for r in rows) == sorted(
        (c, m) for m in modes for c in cases if m == "te" or c not in te_only)
    for mode in modes:
        base = next(r for r in rows if r["case"] == "base" and r["mode"] == mode)
        for r in (r for r in rows if r["mode"] == mode):
            assert len(r["loss"]) == 3
            if r["case"] in OTHER_MODEL:
                continue
            loss_tol, norm_tol = (1e-4, 1e-2) if r["case"] in OTHER_KERNELS else (1e-5, 1e-3)
            assert abs(r["loss"][0] - base["loss"][0]) <= loss_tol * base["loss"][0], (mode, r["case"])
            assert abs(r["grad_norm"][0] - base["grad_norm"][0]) <= norm_tol * base["grad_norm"][0], (mode, r["case"])
            assert abs(r["loss"][2] - base["loss"][2]) <= 1e-3 * base["loss"][2], (mode, r["case"])
    if len(modes) == 2:
        te, local = (next(r for r in rows if r["case"] == "base" and r["mode"] == m) for m in modes)
        assert abs(te["loss"][0] - local["loss"][0]) <= 2e-3 * local["loss"][0], (te["loss"], local["loss"])


@pytest.mark.gpu
def test_two_gpu_layouts_train_and_agree(one_gpu, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ckpt, modes, _, rows1 = one_gpu
    rows = _matrix(2, ckpt, tmp_path / "m2.json", modes)
    assert len(rows) == 8 * len(modes)
    for r in rows:
        base = next(b for b in rows1 if b["case"] == "base" and b["mode"] == r["mode"])
        assert abs(r["loss"][0] - base["loss"][0]) <= 2e-3 * base["loss"][0], (r["case"], r["loss"], base["loss"])


@pytest.mark.parametrize("var,value,message", [
    ("SFTPROF_MATRIX_TE", "te,bogus", "SFTPROF_MATRIX_TE='te,bogus': accepted: a comma list of ['te', 'local']"),
    ("SFTPROF_MATRIX_CASES", "base, c2e2 base", "SFTPROF_MATRIX_CASES: unknown ['c2e2 base']; accepted (a comma list "
                                               "of one-GPU cases): ['base', 'overlap_param_gather=false', "),
])
def test_matrix_part_refuses_unknown_modes_and_cases(monkeypatch, var, value, message):
    """CPU: a bad part of the matrix fails naming the variable and the accepted values (a two-GPU case too)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(pytest.fail.Exception) as err:
        _wanted()
    assert str(err.value).startswith(message), str(err.value)


def _row(case, mode, loss0, ok=True):
    return {"case": case, "mode": mode, "layout": "megatron:d1", "ok": ok, "loss": [loss0, 11.5], "grad_norm": [12.9],
            "step_s": 0.5, "peak_gib_rank0": 27.7}


def _bench(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``settings_matrix.py ARGS`` in this process (``--rows`` runs nothing): exit status, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["settings_matrix.py", *map(str, args)])
    try:
        code = _bench_module().main()
    except SystemExit as stop:  # argparse's error: exit 2
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rows_of_parts_print_as_one_table_and_merge(tmp_path, monkeypatch, capsys):
    """CPU: ``--rows`` puts two parts' rows side by side (modes in MODES order, a later file's row replacing an
    earlier one of the same case and mode) and ``--out`` writes them merged; nothing runs."""
    a, b, merged = tmp_path / "te.json", tmp_path / "local.json", tmp_path / "m.json"
    a.write_text(json.dumps([_row("base", "te", 12.5), _row("n_mbs=1", "te", 12.4)]))
    b.write_text(json.dumps([_row("base", "local", 12.3), _row("base", "te", 12.6)]))
    code, out, err = _bench(monkeypatch, capsys, "--rows", b, a, "--out", merged)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["case", "layout", "te:", "loss", "s0/last", "gnorm0", "last-step", "peak", "local:",
                                "loss", "s0/last", "gnorm0", "last-step", "peak"]
    assert lines[1].split() == ["base", "megatron:d1", "12.50000/11.50000", "12.9000", "0.500s", "27.7GiB",
                                "12.30000/11.50000", "12.9000", "0.500s", "27.7GiB"]
    assert lines[2].split() == ["n_mbs=1", "megatron:d1", "12.40000/11.50000", "12.9000", "0.500s", "27.7GiB", "-"]
    assert json.loads(merged.read_text()) == [_row("base", "local", 12.3), _row("base", "te", 12.5),
                                              _row("n_mbs=1", "te", 12.4)]


@pytest.mark.parametrize("content,args,message", [
    (None, [], "--rows {p}: FileNotFoundError: "),
    ("x", [], "--rows {p}: JSONDecodeError: "),
    ("{}", [], "--rows {p}: not a non-empty JSON list of rows"),
    (json.dumps([{"case": "base", "mode": "te"}]), [], "--rows {p}: row 0: missing ['ok', 'loss', 'grad_norm']"),
    (json.dumps([_row("base", "bogus", 1.0)]), [], "--rows {p}: row 0: mode 'bogus' not one of ['te', 'local']"),
    (json.dumps([_row("base", "te", 1.0)]), ["--te", "local"],
     "--rows prints saved rows and takes only --out (the merged rows); also given: ['--te']"),
])
def test_rows_refuses_bad_files_naming_them(tmp_path, monkeypatch, capsys, content, args, message):
    path = tmp_path / "rows.json"
    if content is not None:
        path.write_text(content)
    code, out, err = _bench(monkeypatch, capsys, "--rows", path, *args)
    assert code == 2 and out == ""
    assert f"settings_matrix.py: error: {message.format(p=path)}" in err, err


@pytest.mark.parametrize("flag,value", [("--per-gpu", "-1"), ("--nproc", "0")])
def test_matrix_refuses_bad_counts_before_anything(flag, value, tmp_path):
    """CPU: checked before CUDA is looked for (``--per-gpu -1`` used to leave the pool with no slot, waiting forever)."""
    args = {"--nproc": "1", "--per-gpu": "0", flag: value}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "settings_matrix.py"), "--checkpoint", str(tmp_path / "c"),
                           *[x for kv in args.items() for x in kv]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.endswith(f"error: --nproc {args['--nproc']} must be >= 1 and --per-gpu {args['--per-gpu']} >= 0 "
                                "(0: from the GPU's memory)\n"), proc.stderr
    assert not (tmp_path / "c").exists()


def test_pool_parses_results_and_stops_a_case_past_its_timeout(tmp_path, monkeypatch):
    """CPU: the pool with a stand-in for ``python -m torch.distributed.run`` (a script that prints a RESULT line
    for one case and hangs for the other): the first row is parsed, the hung case is stopped after
    ``--case-timeout`` and recorded as failed with its exit status; no child is left running."""
    import argparse

    matrix = _bench_module()
    fake = tmp_path / "fake_python"
    pidfile = tmp_path / "pids"
    fake.write_text("#!/bin/bash\necho $$ >> %s\ncase \"$*\" in\n  *'--case base '*) echo 'RESULT {\"case\": \"base\", "
                    "\"ok\": true, \"loss\": [1.5], \"grad_norm\": [2.5]}' ;;\n  *) exec sleep 600 ;;\nesac\n" % pidfile)
    fake.chmod(0o755)
    monkeypatch.setattr(matrix.sys, "executable", str(fake))
    args = argparse.Namespace(nproc=1, checkpoint=tmp_path / "c", seq=8, steps=1, case_timeout=3.0)
    rows = matrix._run_pool([("base", "local"), ("n_mbs=1", "local")], ["0", "0"], args)
    assert rows[0] == {"case": "base", "ok": True, "loss": [1.5], "grad_norm": [2.5]}
    assert (rows[1]["case"], rows[1]["mode"], rows[1]["ok"], rows[1]["error"]) == (
        "n_mbs=1", "local", False, "exit -9: settings_matrix: case stopped after --case-timeout 3 s")
    for pid in map(int, pidfile.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
