"""Atomic writes: a reader (or a resumed run) sees the old version or the new one, never half.

Files and directories are written under a temporary name beside their destination, flushed to
disk, and moved into place with ``os.replace``. A directory that already exists is first moved
aside to ``.NAME.old``: a crash between the two renames leaves that old copy (and the complete
new one), which :func:`recover_dir` puts back in place, so there is no moment after which
neither version can be found. Temporary files and directories get the modes a plain
``open`` / ``mkdir`` would give them (not ``tempfile``'s owner-only ones).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` as indented JSON, atomically and durably."""
    return write_text(path, json.dumps(payload, indent=2, default=str))


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``, atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, removed on failure
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
        delete=False,
    )  # fmt: skip
    tmp = Path(f.name)
    try:
        with f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        normal_mode(tmp)
        os.replace(tmp, path)
    except BaseException:  # nothing half written stays behind
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def normal_mode(path: Path) -> None:
    """Give a file or directory made by ``tempfile`` (owner-only) the mode a plain ``open`` or
    ``mkdir`` would: 0666 or 0777 less the umask."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def old_copy(final: Path) -> Path:
    """Where :func:`replace_dir` keeps the previous version of ``final`` while it swaps."""
    return final.with_name(f".{final.name}.old")


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the fully written directory ``tmp`` to ``final``, replacing an older one."""
    recover_dir(final)
    old = old_copy(final)
    if final.exists():
        _remove(old)  # a finished swap's leftover
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _remove(old)


def recover_dir(final: Path, new: Path | None = None) -> bool:
    """Finish a :func:`replace_dir` that a crash cut between its two renames: ``final`` is
    missing and its old copy is there. The new version ``new`` takes its place where it is
    given and complete (it is only ever renamed once written), else the old copy comes back.
    Returns whether anything was recovered."""
    old = old_copy(final)
    if final.exists() or not old.is_dir():
        return False
    if new is not None and new.is_dir():
        os.replace(new, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, final)
    _fsync_dir(final.parent)
    return True


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside ``path`` that replaces ``path`` when the block succeeds
    and disappears when it fails (one a killed writer left is cleared first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):  # a killed writer's
        _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    normal_mode(tmp)
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync_file(file)
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):  # a filesystem that cannot sync a directory: the rename stands
        _fsync_file(path)
