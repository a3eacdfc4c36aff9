"""Issue 48: six more fault kinds (and three smaller ones) get a right figure, a warning saying what was seen and
left out, or a refusal naming the file and the fault; never a quiet wrong figure.

Inputs are built from the real H200 fixtures (the cut kernel trace and memory snapshot of
``tests/test_malformed_inputs.py``) and the tiny CPU preset; each test asserts exact values.
"""
import copy
import json
import pickle

from test_malformed_inputs import (SNAP_NAME, _log_dir, _put_snapshot, _put_trace, _trace_text,  # noqa: F401
                                   full_trace, small_snapshot, small_trace)
from sftprof.analysis.summary import postprocess_trial
from sftprof.analysis.trace_check import CATEGORY_ALIAS_NOTE

OLD_SPELLING = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset", "cuda_runtime": "Runtime"}


# ---------------------------------------------------------------------------------------------------------
# Kind 6: category spellings of other kineto versions
# ---------------------------------------------------------------------------------------------------------
def test_old_kineto_category_spellings_keep_every_gpu_figure(tmp_path, small_trace):
    """The same trace with kineto's older spellings (Kernel, Memcpy, Memset, Runtime) gives the same GPU figures
    as with today's, and one warning counts the events read so."""
    old = copy.deepcopy(small_trace)
    n = 0
    for e in old["traceEvents"]:
        if e.get("cat") in OLD_SPELLING:
            e["cat"] = OLD_SPELLING[e["cat"]]
            n += 1
    assert n > 30
    log = _log_dir(tmp_path)
    _put_trace(log, 0, _trace_text(small_trace))
    _put_trace(log, 1, _trace_text(old))
    summary, code = postprocess_trial(str(log), str(tmp_path / "run"), "kernel", 1, jobs=1)
    assert code == 0 and summary["errors"] == []
    today, other = (t["summary"] for t in summary["kernel_traces"])
    assert other["gpu"]["activities"] > 30
    assert {k: v for k, v in other.items() if k != "view_repairs"} == \
        {k: v for k, v in today.items() if k != "view_repairs"}  # every figure, GPU and host, the same
    assert other["view_repairs"] == {**today["view_repairs"], CATEGORY_ALIAS_NOTE: n}
    mine = [w["warning"] for w in summary["warnings"] if w["file"] == "perf_tracer/traces-r1.chrome.json"]
    assert f"{n} events with {CATEGORY_ALIAS_NOTE}: their figures are kept; the views keep the trace's own " \
           "spelling" in mine
    assert not any(CATEGORY_ALIAS_NOTE in w["warning"] for w in summary["warnings"]
                   if w["file"] == "perf_tracer/traces-r0.chrome.json")
