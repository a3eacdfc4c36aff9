"""Restricted unpickling of CUDA caching-allocator snapshots.

``torch.cuda.memory._dump_snapshot`` writes a pickle of plain data (dicts, lists, tuples, str,
int, float, bool, None). Unpickling an untrusted file with :func:`pickle.load` can call any
importable function (``os.system`` via ``__reduce__``), so snapshots are loaded with an
unpickler whose ``find_class`` admits only a handful of builtin container/scalar types and
whose ``persistent_load`` refuses persistent ids. Every other global stops the load with
:class:`UnsafePickleError` before anything is called.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
from typing import Any

__all__ = ["UnsafePickleError", "ALLOWED_GLOBALS", "safe_load", "safe_load_file"]

# Builtin containers and scalars that older pickle protocols reference by name.
ALLOWED_GLOBALS = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("builtins", "slice"), ("builtins", "range"),
    ("collections", "OrderedDict"),
})


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle references a global outside :data:`ALLOWED_GLOBALS`; the message names the file."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        if module == "__builtin__":  # protocols 0-2 spell builtins the Python 2 way
            module = "builtins"
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self._source}: refusing to unpickle global '{module}.{name}' "
            "(memory snapshots may only contain builtin containers and scalars)")

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self._source}: refusing pickle persistent id {pid!r}")


def safe_load(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` admitting only builtin containers and scalars.

    Raises:
        UnsafePickleError: the pickle references any other global (``source`` names the file).
        pickle.UnpicklingError, EOFError: truncated or corrupt pickle.
    """
    return _RestrictedUnpickler(io.BytesIO(data), source).load()


def safe_load_file(path: str | os.PathLike) -> Any:
    """Load a snapshot file (``.pickle`` or gzip ``.pickle.gz``) with :func:`safe_load`.

    Raises:
        UnsafePickleError: a disallowed global (message names ``path``).
        ValueError: truncated or corrupt file (message names ``path``).
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return _RestrictedUnpickler(f, path).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, gzip.BadGzipFile, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable snapshot pickle ({type(exc).__name__}: {exc})") from None
