"""Restricted unpickling of CUDA caching-allocator snapshots.

``torch.cuda.memory._dump_snapshot`` writes a protocol-4 pickle of plain data built only from
opcodes that need no global at all (dicts, lists, tuples, str, int, float, bool, None: the real
fixtures in ``tests/fixtures/`` use no ``GLOBAL``/``STACK_GLOBAL``/``REDUCE``). Unpickling an
untrusted file with :func:`pickle.load` can call any importable function (``os.system`` via
``__reduce__``), and even "harmless" builtins amplify resources (``bytearray(2**62)``,
``range``/``set`` of a huge argument from a 46-byte file). So no callable is reachable here:
``find_class`` refuses every global and ``persistent_load`` every persistent id, with
:class:`UnsafePickleError`, before anything is called.

Without callables every object the unpickler builds is made from bytes of the input, so the
input's (decompressed) size bounds what loading allocates; the one remaining amplifier is a
length field (``FRAME``, ``BINBYTES8``, ...) that asks the file object for more bytes than exist,
which :class:`_BoundedReader` answers with at most what the file holds, in bounded pieces.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib
from typing import Any, NoReturn, Protocol

__all__ = ["UnsafePickleError", "safe_load", "safe_load_file"]

_READ_PIECE = 64 << 20  # bytes asked of the underlying stream per read (bounds one allocation)


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle references a global or a persistent id (a callable); the message names the file."""


class _Stream(Protocol):
    """What the unpickler reads from: a binary file (plain or gzip)."""

    def read(self, size: int = ..., /) -> bytes: ...

    def readline(self, size: int = ..., /) -> bytes: ...


class _BoundedReader:
    """File-like wrapper whose ``read(n)`` never allocates more than what the stream really holds.

    ``BufferedReader.read(n)`` (and so ``GzipFile.read``) allocates ``n`` bytes up front; a corrupt
    length field of 2**60 then raises ``MemoryError``. Reading in pieces of at most
    :data:`_READ_PIECE` bytes stops at the real end of the stream instead.
    """

    def __init__(self, f: _Stream) -> None:
        self._f = f

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            return self._f.read()
        if n <= _READ_PIECE:
            return self._f.read(n)
        pieces: list[bytes] = []
        while n > 0:
            piece = self._f.read(min(n, _READ_PIECE))
            if not piece:
                break
            pieces.append(piece)
            n -= len(piece)
        return b"".join(pieces)

    def readline(self) -> bytes:
        return self._f.readline(_READ_PIECE)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: _Stream, source: str) -> None:
        super().__init__(_BoundedReader(file))
        self._source = source

    def find_class(self, module: str, name: str) -> NoReturn:
        raise UnsafePickleError(
            f"{self._source}: refusing to unpickle global '{module}.{name}' (memory snapshots hold only "
            "dicts, lists, tuples, str, int, float, bool and None; no callable is admitted)")

    def persistent_load(self, pid: Any) -> NoReturn:
        raise UnsafePickleError(f"{self._source}: refusing pickle persistent id {pid!r}")


def safe_load(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` admitting only plain data (no global, no persistent id).

    Raises:
        UnsafePickleError: the pickle references a global (``source`` names the file).
        pickle.UnpicklingError, EOFError: truncated or corrupt pickle.
    """
    return _RestrictedUnpickler(io.BytesIO(data), source).load()


def safe_load_file(path: str | os.PathLike[str]) -> Any:
    """Load a snapshot file (``.pickle`` or gzip ``.pickle.gz``) with :func:`safe_load`'s rules.

    Raises:
        UnsafePickleError: a global or persistent id (message names ``path``).
        ValueError: truncated or corrupt file, whatever the unpickler raised on it (message names
            ``path`` and the original exception type).
        OSError: the file cannot be opened.
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return _RestrictedUnpickler(f, path).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, gzip.BadGzipFile, zlib.error, ValueError, IndexError, KeyError,
            TypeError, AttributeError, MemoryError, OverflowError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable snapshot pickle ({type(exc).__name__}: {exc})") from None
