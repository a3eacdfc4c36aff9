r"""Streaming read and write of Chrome-trace JSON files (torch.profiler ``export_chrome_trace``).

A Chrome trace is one JSON object whose ``traceEvents`` member is an array of small event
objects; the other members (``deviceProperties``, ``distributedInfo``, ``traceName``, ...)
are small. Traces of long-context MoE steps reach several GiB, so they are never loaded as
a whole: :class:`TraceReader` decodes the file in fixed-size chunks and parses one event
object at a time, yielding the parsed event together with its exact source text (so writers copy
events without re-encoding). Peak memory is O(chunk size + largest event), independent of the trace size.

Two parsers give the same events: ``orjson`` (2.7x faster per event) reads the events of a chunk
cut at the text that separates two events (``},\n  {`` in kineto's traces, learnt from the
first two events), each cut piece checked by orjson reading it as one whole object; the C scanner
of the standard ``json`` module reads the rest: a piece orjson refuses (``NaN`` and ``Infinity``
among them), and every chunk that may hold an integer orjson reads as a float (:func:`_big_int`). A reader that
needs no text (the summary's pass: :meth:`TraceReader.events_without_text`) has orjson read about 8 KiB of events
at a time as one array, and the text of an event found only when asked (an invalid event's).

Gzip input (``*.json.gz``) is read transparently; :class:`TraceWriter` writes plain or gzip
output.
"""
from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import os
import queue
import re
import sys
import threading
import time
from typing import Any, Callable, Iterator, TextIO, cast

import orjson

from sftprof.atomic import write_failed

__all__ = ["TraceFormatError", "TraceReader", "TraceWriter", "Progress"]

# characters decoded per refill (~1 MiB of ASCII trace text; 8 MiB read 1.3x slower: each block's fresh pages)
_CHUNK_CHARS = 1 << 20
_BATCH_CHARS = 8 << 10  # events read by one orjson call without their text (about 50: 0.6x the time of one by one)
_SEP = re.compile(r"[ \t\n\r,]*")  # between array elements: whitespace and the comma
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# (value, end) of the JSON value at an index: the C scanner JSONDecoder sets up (typeshed does not declare it)
_SCAN: Callable[[str, int], tuple[Any, int]] = getattr(_DECODER, "scan_once")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_INT64_DIGITS = b"0" * 19
_ZEROS = re.compile(b"0*")


def _big_int(data: bytes) -> bool:
    """Whether ``data`` may hold an integer that orjson reads as a float (outside ``-2**63 .. 2**64 - 1``; the
    standard library keeps it an int): a run of 20 digits or more, or of 19 after a minus sign, that is not a
    fraction's (after a point). Also true of such runs in strings: those chunks are read by the slower parser."""
    digits = data.translate(_DIGITS_AS_ZERO)
    i = digits.find(_INT64_DIGITS)
    while i >= 0:
        end = _ZEROS.match(digits, i).end()  # type: ignore[union-attr]  # "0*" matches anywhere: never None
        before = data[i - 1:i]
        if before != b"." and (end - i > 19 or before == b"-"):
            return True
        i = digits.find(_INT64_DIGITS, end)
    return False


_BRACKET_OR_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[][{}]')


def _object_end(buf: str, pos: int) -> int:
    """The index after the JSON value that starts at ``buf[pos]`` (an object or array that orjson read: valid JSON),
    found by counting brackets outside strings: no recursion, so an event nested deeper than the standard library's
    scanner recurses (orjson reads 1024 levels) is found too."""
    depth = 0
    for m in _BRACKET_OR_STRING.finditer(buf, pos):
        c = m.group()
        if c == "{" or c == "[":
            depth += 1
        elif c == "}" or c == "]":
            depth -= 1
            if not depth:
                return m.end()
    raise ValueError(f"no JSON value ends after index {pos}")


class TraceFormatError(ValueError):
    """A trace file is truncated or is not Chrome-trace JSON; the message names the file and offset."""


class Progress:
    """Rate-limited progress lines on stderr for long conversions.

    Args:
        label: prefix of each line (e.g. the file name).
        total_bytes: size of the input in bytes (compressed size for gzip input), 0 if unknown.
        every_s: minimum seconds between two lines.
    """

    def __init__(self, label: str, total_bytes: int, every_s: float = 2.0, stream: TextIO | None = None):
        self.label, self.total, self.every_s = label, total_bytes, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self._last = self.t0

    def update(self, done_bytes: int, force: bool = False) -> None:
        """Print ``label: done/total MiB (pct%) elapsed`` if ``every_s`` passed since the last line."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        pct = f" ({100.0 * done_bytes / self.total:.0f}%)" if self.total else ""
        print(f"[postprocess] {self.label}: {done_bytes / 2**20:.0f}/{self.total / 2**20:.0f} MiB{pct} "
              f"{now - self.t0:.1f} s", file=self.stream, flush=True)


class TraceReader:
    """Single-pass streaming parser of one Chrome-trace file.

    Usage::

        reader = TraceReader(path)
        for raw, event in reader.events():   # raw: str source text of the event, event: dict
            ...
        reader.header                        # dict of all top-level members except traceEvents

    ``header`` holds the members found before ``traceEvents`` while iterating and all members
    once :meth:`events` is exhausted. A bare top-level array (``[{...}, ...]``, also legal
    Chrome-trace JSON) is accepted with an empty header. ``nonfinite_text`` is False when orjson read the last
    event: it refuses ``NaN`` and ``Infinity``, so that event has no non-finite number.

    Args:
        path: ``.json`` or ``.json.gz`` file.
        progress: optional :class:`Progress`, fed with the number of (compressed) bytes read.

    Raises:
        TraceFormatError: truncated file, malformed JSON, or no ``traceEvents`` array (message names
            the file and the character offset).
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str], progress: Progress | None = None):
        self.path = os.fspath(path)
        self.header: dict[str, Any] = {}
        self.progress = progress
        self._raw = open(self.path, "rb")
        self._gz = self.path.endswith(".gz")
        self._bin = gzip.GzipFile(fileobj=self._raw, mode="rb") if self._gz else self._raw
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._pos = 0
        self._base = 0  # characters consumed before self._buf
        self._eof = False
        self.nonfinite_text = False  # whether the last event may hold NaN or Infinity (orjson refuses them)
        self._tail = b""  # the last bytes read: a run of digits across two reads is seen whole by _big_int
        self._big_end = 0  # where the text of the last read that may hold an integer orjson misreads ends
        self._orjson_reads = False  # whether orjson reads the buffer as the standard library does
        self._cut = ""  # the text between two events, from the end of one to the start of the next: "},\n  {"
        self._lazy: list[Any] | None = None  # events yielded without text: [buf, events, an event's start, its index]

    # -- buffer management ------------------------------------------------------------------
    def _fill(self) -> bool:
        """Append the next chunk to the buffer, dropping consumed text; False at end of file."""
        if self._eof:
            return False
        try:
            data = self._bin.read(_CHUNK_CHARS)
        except (EOFError, OSError, gzip.BadGzipFile) as exc:  # truncated / corrupt gzip stream
            raise self._error(f"corrupt compressed stream ({exc})") from None
        self._eof = not data
        text = self._dec.decode(data, final=self._eof)
        self._base += self._pos
        self._buf = self._buf[self._pos:] + text
        self._pos = 0
        if _big_int(self._tail + data):
            self._big_end = self._base + len(self._buf)
        self._tail = data[-20:]
        self._orjson_reads = self._big_end <= self._base
        if self.progress is not None and data:
            self.progress.update(self._raw.tell())
        return bool(data) or bool(text)

    def _error(self, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}: {what} near character {self._base + self._pos}")

    def _skip(self, pattern: re.Pattern[str]) -> None:
        """Move the cursor past the text ``pattern`` (one of the ``[...]*`` patterns: it matches anywhere) matches."""
        while True:
            self._pos = pattern.match(self._buf, self._pos).end()  # type: ignore[union-attr]  # never None
            if self._pos < len(self._buf) or not self._fill():
                return

    def _peek(self) -> str:
        """Next non-whitespace character ('' at end of file)."""
        self._skip(_WS)
        return self._buf[self._pos] if self._pos < len(self._buf) else ""

    def _expect(self, ch: str) -> None:
        got = self._peek()
        if got != ch:
            raise self._error(f"expected {ch!r}, found {got!r}" if got else f"truncated (expected {ch!r})")
        self._pos += 1

    def _value(self) -> tuple[Any, int, int]:
        """Parse one JSON value at the cursor; returns (value, start, end) indexes into ``_buf``."""
        self._peek()
        while True:
            start = self._pos
            try:
                value, end = _SCAN(self._buf, start)
            except (StopIteration, json.JSONDecodeError) as exc:
                # Either the value straddles the buffer end (read more and retry) or it is malformed.
                if self._fill():
                    continue
                detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "no JSON value"
                raise self._error(f"truncated or malformed JSON ({detail})") from None
            if end == len(self._buf) and not self._eof:
                # A number at the buffer end may continue in the next chunk.
                if self._fill():
                    continue
            self._pos = end
            return value, start, end

    # -- public iteration -------------------------------------------------------------------
    def events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield ``(raw_text, event_dict)`` for every element of ``traceEvents`` in file order."""
        return cast(Iterator[tuple[str, dict[str, Any]]], self._events(True))

    def events_without_text(self) -> Iterator[tuple[str | None, dict[str, Any]]]:
        """:meth:`events`, but the events orjson reads some at a time (about 8 KiB of text a call: most of a kineto
        trace) come with None for their text, which :meth:`last_raw` finds when asked."""
        return self._events(False)

    def _events(self, with_raw: bool) -> Iterator[tuple[str | None, dict[str, Any]]]:
        try:
            first = self._peek()
            if first == "[":
                self._pos += 1
                yield from self._array(with_raw)
                return
            self._expect("{")
            seen_events = False
            while True:
                ch = self._peek()
                if ch == "}":
                    self._pos += 1
                    break
                if ch == ",":
                    self._pos += 1
                    continue
                key, _, _ = self._value()
                if not isinstance(key, str):
                    raise self._error("object key is not a string")
                self._expect(":")
                if key == "traceEvents":
                    self._expect("[")
                    seen_events = True
                    yield from self._array(with_raw)
                else:
                    self.header[key], _, _ = self._value()
            if not seen_events:
                raise self._error("no 'traceEvents' array in the trace")
            if self._peek():
                raise self._error("trailing data after the trace object")
        finally:
            if self.progress is not None:
                self.progress.update(self._raw.tell(), force=True)
            self.close()

    @staticmethod
    def _batch(buf: str, start: int, end: int) -> list[dict[str, Any]] | None:
        """The events of ``buf[start:end + 1]`` (from an event's ``{`` to the ``}`` before a cut) read by orjson as
        one array (a whole 8 MiB chunk at once took 2.5x the time of one by one), or None when orjson refuses that
        text or an element is not an object (the per-event path then finds where). Whatever the cuts in the text, the
        array orjson reads from an event's start is the trace's events in it: JSON text is read one way."""
        try:
            batch = orjson.loads(f"[{buf[start:end + 1]}]")
        except orjson.JSONDecodeError:
            return None
        return batch if set(map(type, batch)) == {dict} else None

    def last_raw(self, event: dict[str, Any]) -> str:
        """The source text of ``event``, the last event that :meth:`events_without_text` yielded with None for its
        text, found with the standard library's scanner when asked (an invalid event's). Raises ValueError when the
        last event came with its text."""
        if self._lazy is None:
            raise ValueError("the last event was yielded with its text")
        buf: str = self._lazy[0]
        batch, pos, at = self._lazy[1:]  # at: the index in batch of the event that starts at pos
        index = next(i for i in range(at, len(batch)) if batch[i] is event)
        sep: Callable[[str, int], re.Match[str]] = _SEP.match  # type: ignore[assignment]  # "[...]*": never None
        for _ in range(index - at):
            pos = sep(buf, _object_end(buf, pos)).end()
        self._lazy[2:] = pos, index
        return buf[pos:_object_end(buf, pos)]

    def _array(self, with_raw: bool) -> Iterator[tuple[str | None, dict[str, Any]]]:
        buf_scan = _SCAN
        sep: Callable[[str, int], re.Match[str]] = _SEP.match  # type: ignore[assignment]  # "[...]*": never None
        loads = orjson.loads
        while True:
            buf, pos = self._buf, self._pos
            limit = len(buf) - 65536 if not self._eof else len(buf)
            stop = limit  # where the standard library's scanner hands back to orjson
            cut = self._cut
            if cut and self._orjson_reads:
                self.nonfinite_text = False
                pos = sep(buf, pos).end()
                end = buf.rfind(cut, pos)
                while not with_raw and pos < end and buf[pos] == "{":  # events without text: some at a time
                    upto = buf.find(cut, pos + _BATCH_CHARS)
                    upto = end if upto < 0 else upto
                    batch = self._batch(buf, pos, upto)
                    if batch is None:  # the path below finds where
                        break
                    self._lazy = [buf, batch, pos, 0]
                    yield from zip(itertools.repeat(None), batch)
                    pos = upto + len(cut) - 1  # the next event's "{"
                self._lazy = None
                if end > pos and buf[pos] == "{":
                    # Every piece between two cuts is an event when orjson reads it as one object: the event that
                    # starts at the piece's start is the one object that text can be.
                    step = len(cut) - 2
                    for piece in buf[pos + 1:end].split(cut):
                        raw = f"{{{piece}}}"
                        try:
                            event = loads(raw)
                        except orjson.JSONDecodeError:  # a cut inside an event, or text orjson refuses
                            stop = pos + len(raw)
                            self._cut = ""  # learnt again from the events the standard library reads
                            break
                        yield raw, event
                        pos += len(raw) + step
            # The standard library's scanner, straight from the buffer; the careful path near its end.
            self.nonfinite_text = True
            while pos < stop:
                pos = sep(buf, pos).end()
                if pos >= stop:
                    break
                if buf[pos] == "]":
                    self._pos = pos + 1
                    return
                try:
                    event, end = buf_scan(buf, pos)
                except (StopIteration, json.JSONDecodeError):
                    break  # malformed, or an event running past the buffer's end: the careful path decides
                if type(event) is not dict:
                    self._pos = pos
                    raise self._error("trace event is not a JSON object")
                yield buf[pos:end], event
                pos = end
                if not self._cut:
                    nxt = sep(buf, end).end()
                    if buf.startswith("{", nxt) and "," in buf[end:nxt]:
                        self._cut = buf[end - 1:nxt + 1]
                        stop = min(stop, nxt)  # orjson from the next event on
            self._pos = pos
            if pos >= stop and (stop < limit or not self._eof):
                if stop == limit:  # near the buffer's end: the next chunk, then the fast paths again
                    self._fill()
                continue
            self._skip(_SEP)
            if self._pos >= len(self._buf):
                raise self._error("truncated trace (traceEvents array not closed)")
            if self._buf[self._pos] == "]":
                self._pos += 1
                return
            event, start, end = self._value()
            if type(event) is not dict:
                raise self._error("trace event is not a JSON object")
            yield self._buf[start:end], event

    @property
    def separator(self) -> str:
        """The text between two events learnt from the first ones (``},\n  {`` in kineto's traces, ``},\n{`` in
        :class:`TraceWriter`'s), ``""`` until two events were read."""
        return self._cut

    def close(self) -> None:
        """Close the underlying file (idempotent)."""
        if self._bin is not self._raw:
            self._bin.close()
        self._raw.close()


class TraceWriter:
    """Write a Chrome-trace JSON file incrementally: header members, then events, then the close.

    Events are JSON texts (the reader's raw slices, or ``json.dumps`` output), one per line.
    Hot loops may append to :attr:`pending` directly and call :meth:`flush` now and then;
    :meth:`write` does both. Output is valid JSON that Perfetto and chrome://tracing open. The file is written by a
    thread of its own (the disk's time overlaps the caller's parsing; at most :data:`QUEUED` chunks wait), so an
    error of the file (a full disk) is raised by the next :meth:`flush` or by :meth:`close`.

    Args:
        path: output path; ``.gz`` suffix selects gzip (compression level 1: fast, ~10x on traces).
        header: top-level members written before ``traceEvents`` (JSON-serialisable).
    Raises:
        WriteError: the file cannot be opened or written (:func:`sftprof.atomic.write_failed`).
    """

    FLUSH_EVENTS = 2048
    QUEUED = 8

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]):
        self.path = os.fspath(path)
        self._f: TextIO
        try:
            if self.path.endswith(".gz"):
                self._f = io.TextIOWrapper(gzip.open(self.path, "wb", compresslevel=1), encoding="utf-8")
            else:
                self._f = open(self.path, "w", encoding="utf-8", buffering=1 << 20)
        except OSError as exc:
            raise write_failed(self.path, exc) from exc
        self._error: Exception | None = None  # the writing thread's, raised by the caller's next call
        self._queue: queue.Queue[str | None] = queue.Queue(self.QUEUED)
        self._thread = threading.Thread(target=self._drain, name=f"TraceWriter {os.path.basename(self.path)}",
                                        daemon=True)
        self._thread.start()
        head = "".join(f"{json.dumps(k)}: {json.dumps(v)},\n" for k, v in header.items())
        self._put("{\n" + head + '"traceEvents": [\n')
        self.pending: list[str] = []  # event texts not yet written
        self.n_events = 0
        self.chars = 0  # characters of event text written (= bytes for ASCII traces)

    def write(self, raw: str) -> None:
        """Append one event given as its JSON text."""
        self.pending.append(raw)
        if len(self.pending) >= self.FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        """Hand the pending events to the writing thread."""
        if not self.pending:
            return
        n = len(self.pending)
        if self.n_events:  # the separator after the events written before, in the same join (no copy of the text)
            self.pending.insert(0, "")
        text = ",\n".join(self.pending)
        self.n_events += n
        self.chars += len(text)
        self._put(text)
        self.pending.clear()

    def _drain(self) -> None:
        """The writing thread: write each queued text until ``None``; after an error, only drain the queue."""
        while (text := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._f.write(text)
                except Exception as exc:  # kept for the caller; the thread goes on draining, so no put blocks
                    self._error = exc

    def _raise_error(self) -> None:
        if isinstance(self._error, OSError):  # a full disk: this file's error, named with the free space
            raise write_failed(self.path, self._error) from self._error
        if self._error is not None:
            raise self._error

    def _put(self, text: str) -> None:
        self._raise_error()
        self._queue.put(text)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self, trailer: dict[str, Any] | None = None) -> None:
        """Finish the array, write ``trailer`` members after it (if any), close the object and file.

        Raises:
            WriteError: the file could not be written (as :meth:`write` and :meth:`flush`).
        """
        self.flush()
        tail = "".join(f",\n{json.dumps(k)}: {json.dumps(v)}" for k, v in (trailer or {}).items())
        self._put("\n]" + tail + "\n}\n")
        self._stop()
        self._raise_error()
        try:
            self._f.close()
        except OSError as exc:
            raise write_failed(self.path, exc) from exc

    def abort(self) -> None:
        """Close and delete a partially written file."""
        try:
            self._stop()
            self._f.close()
        finally:
            if os.path.exists(self.path):
                os.remove(self.path)
