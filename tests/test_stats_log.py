"""``stats.jsonl``'s records written and read back (sftprof/stats_log.py)."""
import json

import pytest

from sftprof import stats_log


def test_stats_written_and_read_back(tmp_path):
    path = tmp_path / "stats.jsonl"
    w = stats_log.StatsWriter(path)
    step = stats_log.StepRecord(step=0, loss=2.5, grad_norm=None, step_time_s=2.0, tokens=2048, tokens_per_s=1024.0,
                                ranks=[{"rank": 0, "step_time_s": 2.0, "mem_peak_allocated_gb": None,
                                        "mem_peak_reserved_gb": None}], profiled=True)
    w.write(step)
    assert json.loads(path.read_text()) == step.to_json()  # flushed at once
    w.write(stats_log.CompletionRecord(status="ok", steps_done=2, world_size=2, backend="fsdp", device="cpu",
                                       profile_kind="kernel", profile_step=0))
    w.close()
    lines = path.read_text().splitlines()
    with open(path, "a") as f:  # damaged lines and a step record of an earlier release (no grad_norm, ...)
        f.write("not json\n[1, 2]\n" + json.dumps({"type": "step", "step": 1, "loss": 2.0}) + "\n")
        # step records whose step is not a non-negative integer: invalid lines, counted and left out
        for bad in ("x", True, -1, 1.0, None):
            f.write(json.dumps({"type": "step", "step": bad, "loss": 2.0}) + "\n")
    assert list(json.loads(lines[0])) == [
        "type", "step", "loss", "grad_norm", "step_time_s", "tokens", "tokens_per_s", "mem_allocated_gb",
        "mem_reserved_gb", "mem_peak_allocated_gb", "mem_peak_reserved_gb", "ranks", "tflops_per_gpu", "mfu",
        "recompute_tflops_per_gpu", "moe_load", "profiled", "started_unix_s", "profiler_s"]
    assert json.loads(lines[1]) == {"type": "complete", "status": "ok", "error": None, "steps_done": 2, "world_size": 2,
                                     "backend": "fsdp", "device": "cpu", "profile_kind": "kernel", "profile_step": 0,
                                     "trainer_started_unix_s": None, "imports_done_unix_s": None,
                                     "engine_build_started_unix_s": None, "ended_unix_s": None}
    log = stats_log.read_stats(path)
    assert log.bad_lines == 7 and len(log.steps) == 2 and log.steps[0] == step
    assert (log.steps[1].step, log.steps[1].loss, log.steps[1].grad_norm, log.steps[1].profiled) == (1, 2.0, None, False)
    assert log.completion.status == "ok" and log.completion.profile_step == 0
    units = stats_log.field_units()
    assert units["step_time_s"].startswith("s: ") and units["mem_peak_allocated_gb"].startswith("GiB")
    with pytest.raises(OSError):
        stats_log.read_stats(tmp_path / "missing.jsonl")
