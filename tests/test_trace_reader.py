"""The trace reader's two parsers give the same events and event texts: orjson, for the events of chunks cut at the
text between two events, and the standard library's scanner (the only parser before), for the rest."""
import gzip
import json
from collections import defaultdict

import orjson
import pytest

from fixtures import gpu_trace_fixtures, make_cpu_trace, two_gpu_sync_traces
from sftprof.analysis.trace import io as trace_io
from sftprof.analysis.trace.io import TraceReader
from sftprof.analysis.views.split import _usable_events


def _read(path, monkeypatch, chunk: int | None = None, stdlib_only: bool = False, with_raw: bool = True):
    """``([(raw, event as json.dumps writes it)], header, orjson calls)``: json.dumps tells 1 from 1.0 and
    -0.0 from 0.0, which == does not. ``with_raw=False``: each event's text as ``last_raw`` finds it where the
    reader gave None."""
    read_by_orjson = []
    loads = orjson.loads

    def counted(text):
        event = loads(text)
        read_by_orjson.append(text)
        return event

    with monkeypatch.context() as m:
        m.setattr(orjson, "loads", counted)
        if chunk is not None:
            m.setattr(trace_io, "_CHUNK_CHARS", chunk)
        if stdlib_only:  # every chunk as one orjson may misread: the standard library's scanner alone
            m.setattr(trace_io, "_big_int", lambda data: True)
        reader = TraceReader(path)
        read = reader.events() if with_raw else reader.events_without_text()
        events = [(reader.last_raw(ev) if raw is None else raw, json.dumps(ev)) for raw, ev in read]
    return events, reader.header, len(read_by_orjson)


@pytest.mark.parametrize("path", gpu_trace_fixtures() + two_gpu_sync_traces(), ids=lambda p: p.name)
def test_real_traces_read_the_same_by_both_parsers(path, monkeypatch):
    events, header, n_orjson = _read(path, monkeypatch)
    old, old_header, none = _read(path, monkeypatch, stdlib_only=True)
    assert none == 0 and events == old and header == old_header
    assert n_orjson >= len(events) - 5  # kineto's traces: all but the first event of each chunk by orjson
    # Short chunks: many cuts, events and the 64 KiB margin across chunk ends.
    assert _read(path, monkeypatch, chunk=70_000)[:2] == (old, old_header)
    # Without the texts: about 8 KiB of events a call (the texts found afterwards), whatever the chunk size.
    for chunk in (None, 70_000):
        events, header, calls = _read(path, monkeypatch, chunk=chunk, with_raw=False)
        assert (events, header) == (old, old_header) and calls < n_orjson / 10


def _usable_both_ways(path) -> dict[bool, tuple[list[tuple[str, str]], list[dict]]]:
    """``{with_raw: (invalid (kind, text) pairs, usable events)}`` of the summary's pass over ``path``, reading the
    events with their texts (True) and without (False)."""
    got = {}
    for with_raw in (True, False):
        invalid: list[tuple[str, str]] = []
        reader = TraceReader(path)
        read = reader.events() if with_raw else reader.events_without_text()
        events = [ev for _, ev in _usable_events(reader, read, lambda kind, raw: invalid.append((kind, raw)),
                                                 defaultdict(int))]
        got[with_raw] = invalid, events
    return got


def test_invalid_events_of_a_real_trace_without_texts(tmp_path):
    """The summary's pass (events without their texts) hands each invalid event's text to ``on_invalid`` as the
    views' pass does: the real reference trace with every 97th duration and a run of 20 made negative."""
    text = gzip.decompress(gpu_trace_fixtures()[-1].read_bytes()).decode()
    parts = text.split('"dur": ')
    bad = parts[0] + "".join(('"dur": -' if k % 97 == 0 or 500 < k < 520 else '"dur": ') + p
                             for k, p in enumerate(parts[1:], start=1))
    path = tmp_path / "bad.json"
    path.write_text(bad)
    got = _usable_both_ways(path)
    assert len(got[True][0]) > 200 and got[True] == got[False]
    assert all(raw.startswith("{") and raw.endswith("}") and '"dur": -' in raw for _, raw in got[False][0])


def test_cpu_trace_in_short_chunks(tmp_path, monkeypatch):
    cpu = make_cpu_trace(tmp_path / "cpu.json")
    old = _read(cpu, monkeypatch, stdlib_only=True)[:2]
    for chunk in (37, 70_000):  # the reader holds 64 KiB of text before either parser reads from it
        events, header, n_orjson = _read(cpu, monkeypatch, chunk=chunk)
        assert (events, header) == old and n_orjson >= len(events) - 2


_PLAIN = '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 1.5, "dur": 2, "args": {"x": 1}}'
_AWKWARD = [
    '{"ph": "X", "name": "a}, {b", "ts": 1, "dur": 1.0}',  # the cut text inside a string
    '{"ph": "X", "ts": 1, "dur": 1, "args": {"l": [{"y": 1}, {"z": -0.0}]}}',  # ... between nested objects
    '{"ph": "X", "ts": 3, "dur": 1, "a": 1, "b": 2, "a": 3}',  # a repeated key: the last value, the first place
    '{"ph": "X", "ts": 2, "dur": NaN}',  # orjson refuses NaN
    '{"ph": "X", "ts": 1e400, "dur": 1}',  # ... a float beyond double's range (the scanner reads inf)
    '{"ph": "M", "name": "\\ud800"}',  # ... a lone surrogate
    '{"ph": "X", "name": "9223372036854775807", "ts": -0, "dur": 9223372036854775807}',  # in 64 bits: orjson's
]
_BIG_INTS = ['{"ph": "i", "ts": 12345678901234567890123, "id": 1}',  # integers orjson reads as floats
             '{"ph": "i", "ts": 5, "id": -9223372036854775809}']


@pytest.mark.parametrize("sep", ["}, {", "},\n  {", "},{"])
def test_events_orjson_refuses_or_misreads(tmp_path, monkeypatch, sep):
    """Cut text inside an event, text orjson refuses and integers it would read as floats, each among 1000 plain
    events: the standard library's reading, event for event, whatever the chunk size."""
    texts = [t for odd in _AWKWARD + _BIG_INTS for t in [_PLAIN] * 1000 + [odd]] + [_PLAIN] * 1000
    path = tmp_path / "t.json"
    path.write_text('{"traceName": "x", "traceEvents": [{' + sep.join(t[1:-1] for t in texts) + "}]}")
    old, old_header, _ = _read(path, monkeypatch, stdlib_only=True)
    assert [raw for raw, _ in old] == texts and old_header == {"traceName": "x"}
    for chunk in (37, 70_000, 100_000, 150_000):
        events, header, n_orjson = _read(path, monkeypatch, chunk=chunk)
        assert (events, header) == (old, old_header) and n_orjson > 1000
    assert _read(path, monkeypatch) == (old, old_header, 0)  # one chunk, which holds a NaN: the scanner reads it all
    for chunk in (37, 70_000, 100_000, 150_000):  # without the texts: the same events, each text found when asked
        assert _read(path, monkeypatch, chunk=chunk, with_raw=False)[:2] == (old, old_header)
    got = [ev for _, ev in TraceReader(path).events() if ev["ph"] == "i"]
    assert [(type(ev["ts"]), ev["ts"], ev["id"]) for ev in got] == [
        (int, 12345678901234567890123, 1), (int, 5, -9223372036854775809)]


@pytest.mark.parametrize("data,big", [
    (b'"ts": 12345678901234567890, ', True), (b'"id": -9223372036854775809}', True),
    (b'"Concrete Inputs": ["9223372036854775807"], "ts": 5134224176982.391', False),
    (b'"id": 9223372036854775807, "x": 1234567890123456789', False),
    (b'"Concrete Inputs": ["[-0.00010526315789473687, -0.000105263157894736871234]"]', False),
    (b'"x": 0.5, "y": 123456789012345678901234.5', True),  # read the same by both, but not told from an integer
])
def test_big_int(data, big):
    assert trace_io._big_int(data) is big


def test_an_invalid_deeply_nested_event_without_texts(tmp_path):
    """An invalid event nested deeper than the standard library's scanner recurses (1010 arrays in its args; orjson
    reads up to 1024, so its batch holds it), and one after a valid such event: the summary's pass (without texts)
    finds their texts as the views' pass has them, instead of a RecursionError."""
    deep = "[" * 1010 + "]" * 1010
    events = [{"ph": "X", "cat": "cpu_op", "name": f"e{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(400)]
    text = json.dumps({"traceEvents": events}, indent=2)
    text = text.replace('"name": "e100"', f'"name": "e100", "args": {{"deep": {deep}}}', 1)
    text = text.replace('"ts": 100,', '"ts": "bad",', 1)
    text = text.replace('"name": "e200"', f'"name": "e200", "args": {{"deep": {deep}}}', 1)
    text = text.replace('"ts": 201,', '"ts": "bad",', 1)
    path = tmp_path / "deep.json"
    path.write_text(text)
    got = _usable_both_ways(path)
    # (the events themselves are not compared: == recurses through the nested args as the scanner did)
    assert got[False][0] == got[True][0] and len(got[False][1]) == len(got[True][1]) == 398
    assert [kind for kind, _ in got[True][0]] == ["non-numeric ts"] * 2 and deep in got[True][0][0][1]
