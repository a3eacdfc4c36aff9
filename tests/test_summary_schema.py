"""profile_summary.json's schema (sftprof/analysis/schema.py): its version, the reader of every consumer, the check.

Every summary the test suite writes is also checked against the schema (tests/conftest.py sets
SFTPROF_STRICT_SCHEMA=1, which makes the writer refuse a summary that departs from it).
"""
import json
import os

import pytest

from sftprof.analysis import schema
from sftprof.analysis.compare.runs import CompareInputError, find_trials
from sftprof.analysis.report.schema import Finding
from sftprof.analysis.trial.schema import TraceEntry, Versions
from sftprof.analysis.what_if.schema import WhatIf, WhatIfSetting
from sftprof.launch import report

MINIMAL = {"schema": "sftprof.profile_summary", "schema_version": "3.0", "trial": "t", "profile_kind": "kernel",
           "profile_step": 1, "status": "ok", "stats": {}, "ranks": {"rows": []}}


def test_a_summary_of_a_newer_major_version_is_refused_by_every_reader(tmp_path):
    run = tmp_path / "run_root" / "trial"
    run.mkdir(parents=True)
    path = run / "profile_summary.json"
    path.write_text(json.dumps(dict(MINIMAL, schema_version="4.1")))
    want = (f"{path}: written by a newer sftprof (summary schema 4.1; this one reads 3.x and older): update sftprof, "
            "or rerun postprocess_profile.py with this one")
    with pytest.raises(schema.SummaryReadError) as err:
        schema.read_summary(path)
    assert str(err.value) == want
    with pytest.raises(CompareInputError) as err:  # compare: exit 2 with that message
        find_trials(str(run))
    assert str(err.value) == want
    # the driver's end table leaves the row's figures out ("-"), as for a missing summary
    (run.parent / "summary.tsv").write_text("trial\tkind\tstep\tstatus\trun_dir\nt\tkernel\t1\t0\t" + str(run) + "\n")
    assert report(run.parent).splitlines()[1].split() == ["kernel", "step", "1", "ok", "-", "-", "-"]
    # a newer minor version is read (it only adds members)
    path.write_text(json.dumps(dict(MINIMAL, schema_version="3.13", new_member=1)))
    assert schema.read_summary(path)["new_member"] == 1
    # an older major version is read, in this version's shape: a 2.x snapshot says nothing of a step peak unknown,
    # and a 2.x trace, whose record was not checked, gets no made-up sanity counts
    old = dict(MINIMAL, schema_version="2.0", profile_kind="memory", memory_snapshots=[
        {"rank": 0, "file": "f", "coords_from_name": None, "summary": {"peak_scope": "recorded_window"}}],
        kernel_traces=[{"rank": 0, "source": "s", "summary": {"n_events": 3}}])
    path.write_text(json.dumps(old))
    s = schema.read_summary(path)
    assert s["memory_snapshots"][0]["summary"] == {"peak_scope": "recorded_window", "step_peak_unknown": None}
    assert s["kernel_traces"][0]["summary"] == {"n_events": 3} and s["schema_version"] == "2.0"
    for text, why in (("[1]", "not a profile summary (a JSON list, expected an object)"),
                      (json.dumps(dict(MINIMAL, schema="other")), "schema 'other' is not 'sftprof.profile_summary': "
                                                                  "not a profile summary"),
                      (json.dumps(dict(MINIMAL, schema_version="two")), "schema_version 'two' is not <major>.<minor>")):
        path.write_text(text)
        with pytest.raises(schema.SummaryReadError) as err:
            schema.read_summary(path)
        assert str(err.value) == f"{path}: {why}"


def test_a_release_1_summary_is_read_in_this_versions_shape():
    v1 = {"schema": "sftprof.profile_summary/1", "profile_kind": "kernel", "profile_step": 1,
          "warnings": [{"file": "perf_tracer/rank3.pt.trace.json", "warning": "rank 3: no trace in the log dir, though "
                        "perf_tracer.ranks='' profiles it; this summary leaves that rank out"},
                       {"file": "stats.jsonl", "warning": "2 unparsable lines skipped"}],
          "kernel_traces": [{"rank": 0, "source": "perf_tracer/rank0.pt.trace.json", "summary": {"n_events": 3}},
                            {"rank": 1, "source": "perf_tracer/rank1.pt.trace.json", "error": "truncated"}]}
    s = schema.from_json(v1, "v1.json")
    assert (s["schema"], s["schema_version"], s["missing_traces"]) == ("sftprof.profile_summary", "1.0", [3])
    assert s["kernel_traces"][0]["summary"] == {"n_events": 3, "cpu_parts": None, "heaviest_op": None}
    assert schema.processed_traces(s) == [s["kernel_traces"][0]]


def test_check_names_every_departure():
    problems = schema.check({"rank": 0, "source": "x", "view_links": {"cpu_only.chrome": 3}, "extra": True},
                            TraceEntry, "t")
    assert problems == ["t.extra: not in TraceEntry", "t.view_links.cpu_only.chrome: expected str, got int"]
    assert schema.check({"text": "a", "section": "#s", "weight": 1, "key": "k", "rank": None}, Finding) == []
    assert schema.check({"text": "a", "section": "#s", "weight": True, "key": "k"}, Finding, "f") == [
        "f.weight: expected float, got bool"]
    assert schema.check({"text": "a"}, WhatIf, "w") == [
        f"w.{k}: missing" for k in ("assumption", "effect", "key", "label", "rank", "settings", "weight")]
    assert schema.check({"kind": "file", "key": "k", "value": 1, "current": None}, WhatIfSetting, "s") == [
        "s.kind: 'file' is not one of ('config', 'env')"]
    # a 3.7 summary's versions (no sftprof, no nccl: added in 3.8) conform; a member of neither does not
    v37 = {"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "megatron_core": "0.19.2",
           "transformer_engine": None, "transformers": "5.17.0", "triton": "3.6.0", "flash_linear_attention": None}
    assert schema.check(v37, Versions, "v") == []
    assert schema.check({**v37, "sftprof": "0.1.0+g85c64d7", "nccl": None}, Versions, "v") == []
    assert schema.check({**v37, "sftprof": 1, "cudnn": "9.1"}, Versions, "v") == [
        "v.cudnn: not in Versions", "v.sftprof: expected str, got int"]


def test_the_strict_writer_refuses_a_summary_that_departs(monkeypatch):
    assert os.environ.get(schema.STRICT_ENV) == "1"  # set by tests/conftest.py for the whole suite
    with pytest.raises(schema.SchemaError) as err:
        schema.summary_json(dict(MINIMAL, unknown=1))
    assert "summary.unknown: not in ProfileSummary" in str(err.value)
    monkeypatch.delenv(schema.STRICT_ENV)  # a real postprocess writes what it has
    assert json.loads(schema.summary_json(dict(MINIMAL, unknown=float("nan"))))["unknown"] is None
