"""On-disk format of a regeneration: numbered JSONL shards beside a manifest, written atomically.

Layout of ``out_dir``::

    manifest.json        settings, model identity and counts (rewritten atomically)
    shard-00000.jsonl    rows in processing order (longest prompt first), each written
    shard-00001.jsonl    atomically (temp file + os.replace), so a shard on disk is complete
    .lock                held (flock) by the one run writing here

Several worker processes may write shards into one ``out_dir`` at once: each numbers its
shards on its own stride, and only the process that holds the lock writes the manifest.

:func:`resume` checks an existing ``out_dir`` against the settings of a new run and returns the
rows already there; :func:`load_regenerated` reads all rows back, in prompt order.
"""

from __future__ import annotations

import fcntl
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets

from specdec.errors import DataError
from specdec.files import write_text

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "specdec-regenerated/1"
_COLUMNS = ("id", "messages", "category", "num_new_tokens", "finished")


def load_regenerated(out_dir: str | Path) -> datasets.Dataset:
    """All rows of a regeneration, in the order of the prompts given to
    :func:`~specdec.data.regenerate.regenerate`.

    Returns:
        Columns ``id``, ``messages`` (the prompt plus the target's assistant turn),
        ``category``, ``num_new_tokens`` and ``finished`` (the response ended with EOS).
    """
    out = Path(out_dir)
    manifest = read_manifest(out)
    if manifest is None:
        raise DataError(f"{out / MANIFEST} not found: {out} holds no regeneration")
    rows = []
    for path in _shard_paths(out):
        rows.extend(_read_shard(path))
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise DataError(f"{out} holds some ids in more than one shard; regenerate it afresh")
    counts = manifest.get("counts", {})
    if not counts.get("complete", False):
        logger.warning("%s is incomplete (%d rows); rerun regenerate to finish it", out, len(rows))
    rows.sort(key=lambda r: r["index"])
    return datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in _COLUMNS})


def resume(
    out: Path, settings: dict, fingerprint: Callable[[dict[str, dict]], str | None] | None = None
) -> dict[str, bool]:
    """Checks ``out`` against ``settings``; returns ``{id: finished}`` of rows already there.

    A prompt set that differs from the one ``out`` was written for is refused, except that it
    may grow: when ``fingerprint`` (given the rows on disk by id) hashes the new set's prompts
    that those rows answer, in the rows' order, to the hash ``out`` holds, the rows are kept
    and only the new prompts are still to do (then :meth:`ShardWriter.renumber`).
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()  # a write that was killed before its os.replace
    manifest = read_manifest(out)
    if manifest is None:
        if _shard_paths(out):
            raise DataError(f"{out} has shards but no {MANIFEST}; use an empty directory")
        return {}
    old = manifest.get("settings", {})
    rows = {r["id"]: r for path in _shard_paths(out) for r in _read_shard(path)}
    for key, value in settings.items():
        if old.get(key) == value:
            continue
        grew = key == "prompts" and fingerprint is not None and old.get(key) is not None
        if grew and fingerprint(rows) == old[key]:
            logger.info("%s: the prompt set grew; its %d rows are kept", out, len(rows))
            continue
        shown = None
        if key == "prompts":
            shown = "a different prompt set or chat template; a complete set may only grow"
        detail = shown or f"{key}={old.get(key)!r} there, {value!r} now"
        raise DataError(
            f"{out} holds a different regeneration ({detail}); use another out_dir or delete it"
        )
    return {pid: row["finished"] for pid, row in rows.items()}


def read_manifest(out: Path, fmt: str = FORMAT) -> dict | None:
    """``out``'s manifest of format ``fmt``, or None when there is none.

    Raises:
        DataError: the manifest is not JSON or not of that format.
    """
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON: {err}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != fmt:
        raise DataError(f"{path} is not a {fmt} manifest (format {found!r})")
    return manifest


def _shard_paths(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.jsonl"), key=_shard_index)


def _shard_index(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def _read_shard(path: Path) -> list[dict]:
    with path.open() as f:
        try:
            return [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as err:
            raise DataError(f"{path} is not valid JSONL: {err}") from None


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Holds ``out/.lock`` for the duration, so two runs never write one ``out_dir`` at once.

    Raises:
        DataError: another process holds it.
    """
    out.mkdir(parents=True, exist_ok=True)
    with (out / ".lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"{out} is being written by another process; wait for it or use another directory"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably (:func:`specdec.files.write_text`): a
    killed run leaves the old file or the whole new one (:func:`resume` clears ``*.tmp``)."""
    write_text(path, text)


class ShardWriter:
    """Buffers rows and writes them as numbered shards, keeping the manifest's counts.

    Args:
        out: the regeneration directory.
        shard_size: rows per shard.
        manifest: the manifest to keep up to date; its ``counts`` are rewritten. None in a
            worker process: the process holding the lock writes it.
        on_disk: ``{id: finished}`` of the rows already in ``out``.
        write_file: writes one file atomically; every shard and the manifest go through it.
        first_index: number of the first shard written; default: after those on disk.
        stride: step between this writer's shard numbers (the number of writers sharing
            ``out``, each starting at its own ``first_index``).
    """

    def __init__(
        self,
        out: Path,
        shard_size: int,
        manifest: dict | None,
        on_disk: dict[str, bool],
        write_file: Callable[[Path, str], None] = write_atomic,
        first_index: int | None = None,
        stride: int = 1,
    ):
        self.out = out
        self.write_file = write_file
        self.shard_size = shard_size
        self.manifest = manifest
        self.buffer: list[dict] = []
        self.num_shards = len(_shard_paths(out))
        after = 1 + max((_shard_index(p) for p in _shard_paths(out)), default=-1)
        self.next_index = after if first_index is None else first_index
        self.stride = stride
        self.num_rows = len(on_disk)
        self.num_finished = sum(on_disk.values())

    def add(self, row: dict) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.shard_size:
            self._write(self.buffer[: self.shard_size])
            self.buffer = self.buffer[self.shard_size :]

    def flush(self) -> None:
        if self.buffer:
            self._write(self.buffer)
            self.buffer = []
        self.write_manifest()

    def _write(self, rows: list[dict]) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        self.write_file(self.out / f"shard-{self.next_index:05d}.jsonl", text)
        self.next_index += self.stride
        self.num_shards += 1
        self.num_rows += len(rows)
        self.num_finished += sum(r["finished"] for r in rows)
        self.write_manifest()

    def renumber(self, place: dict[str, int]) -> int:
        """Give every row on disk its prompt's place in the current prompt list (``place``:
        id to index), rewriting the shards where it differs: after the set grew, the rows
        kept read back where a fresh run would put them. The manifest (already the grown
        set's, marked unfinished) is written first, so a run killed in between finishes the
        renumbering when it resumes. Returns the number of shards rewritten."""
        stale = []
        for path in _shard_paths(self.out):
            rows = _read_shard(path)
            if any(row["index"] != place[row["id"]] for row in rows):
                stale.append((path, [{**row, "index": place[row["id"]]} for row in rows]))
        if stale:
            self.write_manifest(complete=False)  # not read back as complete while mixed
        for path, rows in stale:
            self.write_file(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        if stale:
            self.write_manifest()
        return len(stale)

    def recount(self) -> None:
        """Counts the rows of every shard on disk (other writers' included), then writes the
        manifest."""
        rows = [r for path in _shard_paths(self.out) for r in _read_shard(path)]
        self.num_shards = len(_shard_paths(self.out))
        self.num_rows = len(rows)
        self.num_finished = sum(r["finished"] for r in rows)
        self.write_manifest()

    def write_manifest(self, complete: bool = True) -> None:
        """The manifest with the current counts; ``complete=False`` marks it unfinished
        whatever the counts say."""
        if self.manifest is None:
            return
        counts = self.manifest["counts"]
        expected = counts["num_prompts"] - counts["num_too_long"]
        counts.update(
            num_rows=self.num_rows,
            num_finished=self.num_finished,
            num_truncated=self.num_rows - self.num_finished,
            num_shards=self.num_shards,
            complete=complete and self.num_rows == expected and not self.buffer,
        )
        self.write_file(self.out / MANIFEST, json.dumps(self.manifest, indent=2) + "\n")
