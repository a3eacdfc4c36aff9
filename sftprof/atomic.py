"""Atomic writes: a file is written under a temporary name in its own folder, then renamed to its name.

A reader sees the earlier file or the new one, never a part of one; a write that fails (a full disk, a file-size
limit, a read-only folder) leaves the earlier file as it was, removes the temporary one and raises
:class:`WriteError`, whose message names the file, the reason and, for want of space (:data:`SPACE_ERRNOS`), the free
space in its folder. Temporary files are named ``.<name>.<pid>.<random>.tmp``: one a killed process leaves behind is
recognisable, and safe to delete.

Standard library only: the driver, the postprocessing and the benchmarks share it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from typing import Iterator

__all__ = ["SPACE_ERRNOS", "WriteError", "write_failed", "atomic_path", "put_text", "write_text", "copy_file",
           "free_space"]


# the errors of a write that wants space (a full disk, a quota, a file-size limit): their message names the free space
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class WriteError(OSError):
    """A file that could not be written; the message names it, why, and (:data:`SPACE_ERRNOS`) the free space in its
    folder."""


def free_space(folder: str) -> str:
    """``"1.2 GiB free on /run"``: the space left to an unprivileged user in ``folder``'s file system."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free in {folder}"
    return f"{free} bytes free in {folder}"


def write_failed(path: str, exc: OSError) -> WriteError:
    """The :class:`WriteError` of ``path`` for ``exc`` (its errno and reason kept; the free space in ``path``'s folder
    added for an errno of :data:`SPACE_ERRNOS`)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in SPACE_ERRNOS:
        reason += f" ({free_space(os.path.dirname(os.path.abspath(path)))})"
    err = WriteError(exc.errno, f"cannot write {path}: {reason}; what was there before is left as it was")
    err.filename = path
    return err


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, replace: bool = True) -> Iterator[str]:
    """The temporary path to write ``path``'s content to (an empty file, mode as ``open`` creates); when the block
    ends without an exception it becomes ``path``: renamed over it (``replace``), else linked to it, which fails
    with :class:`FileExistsError` when ``path`` exists by then (never overwritten). On any exception the temporary
    file is removed and ``path`` is left as it was; an :class:`OSError` raised in the block (or by the rename) that
    is not a :class:`WriteError` already is raised as ``path``'s :class:`WriteError`.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as for open()
    except OSError as exc:
        raise write_failed(path, exc) from exc
    try:
        yield tmp
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except (FileExistsError, WriteError):
        raise
    except OSError as exc:
        raise write_failed(path, exc) from exc
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def put_text(tmp: str, text: str) -> None:
    """Write ``text`` (UTF-8, line endings as given) into the temporary file ``tmp`` of :func:`atomic_path`,
    flushed to disk (a full disk can show only there).

    Raises:
        WriteError: naming the file ``tmp`` stands for.
    """
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        folder, name = os.path.split(tmp)
        raise write_failed(os.path.join(folder, name[1:].rsplit(".", 3)[0]), exc) from exc


def write_text(path: str | os.PathLike, text: str, *, replace: bool = True) -> None:
    """Write ``text`` (UTF-8, line endings as given) to ``path`` atomically, flushed to disk before the rename
    (:func:`atomic_path`: ``replace=False`` never overwrites an existing ``path``).

    Raises:
        WriteError: it could not be written; ``path`` is as it was.
        FileExistsError: ``replace`` is False and ``path`` exists.
    """
    with atomic_path(path, replace=replace) as tmp:
        put_text(tmp, text)


def copy_file(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` atomically (:func:`atomic_path`).

    Raises:
        OSError: ``src`` cannot be opened. WriteError: the copy failed (reading or writing); ``dst`` is as it was.
    """
    with open(src, "rb") as f, atomic_path(dst) as tmp, open(tmp, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)
