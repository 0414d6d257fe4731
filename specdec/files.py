"""Atomic writes: a reader (or a resumed run) sees the old version or the new one, never half.

Files and directories are written under a temporary name beside their destination and moved
into place with one ``os.replace``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` as indented JSON, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(f.name, path)
    return path


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the fully written directory ``tmp`` to ``final``, replacing an older one."""
    old = tmp.with_name(tmp.name + "-old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside ``path`` that replaces ``path`` when the block succeeds
    and disappears when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
