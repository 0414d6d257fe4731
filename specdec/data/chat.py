"""Chat rows to messages, and messages to token ids with an assistant-only loss mask.

Rows arrive in the usual shapes (ShareGPT ``conversations``, OpenAI ``messages``,
``prompt``/``instruction`` with an optional response, MT-bench ``turns``) and leave as
OpenAI-style ``[{"role", "content"}]``. The loss mask is derived from the tokenizer's own chat
template, never from hard-coded separators: an assistant turn spans from the end of the
conversation rendered up to it with the generation prompt, to the end of the conversation
rendered through it. That span covers the reply and the tokens that close the turn
(``<|im_end|>``, ``<end_of_turn>``...), not the header that opens it, which is what the model
actually generates at inference time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from datasets import Dataset
from jinja2 import TemplateError

from specdec.errors import ConfigError, DataError, ModelError

logger = logging.getLogger(__name__)

FORMATS = ("auto", "openai", "sharegpt", "prompt", "mtbench")
OVERFLOW = ("truncate", "drop")
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
}
RESPONSE_KEYS = ("response", "output", "completion")


def _label(where: str) -> str:
    return where or "row"


def _content(value: Any, where: str) -> str:
    """Message content as text; OpenAI content parts are joined when they are all text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise DataError(f"{_label(where)}: message content must be text, got {type(value).__name__}")


def _message(item: Any, where: str, role_key: str = "role", text_key: str = "content") -> dict:
    if not isinstance(item, Mapping):
        raise DataError(f"{_label(where)}: each message must be an object, got {item!r:.60}")
    if role_key not in item and "from" in item:
        role_key, text_key = "from", "value"
    if role_key not in item or text_key not in item:
        raise DataError(
            f"{_label(where)}: message needs '{role_key}' and '{text_key}', found {sorted(item)}"
        )
    role = ROLES.get(str(item[role_key]).lower())
    if role is None:
        raise DataError(f"{_label(where)}: unsupported role {item[role_key]!r}")
    return {"role": role, "content": _content(item[text_key], where)}


def _message_list(value: Any, key: str, where: str, **keys: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{_label(where)}: '{key}' must be a non-empty list of messages")
    return [_message(item, where, **keys) for item in value]


def _from_openai(row: Mapping, where: str) -> list[dict]:
    return _message_list(row.get("messages"), "messages", where)


def _from_sharegpt(row: Mapping, where: str) -> list[dict]:
    conversations = row.get("conversations")
    return _message_list(conversations, "conversations", where, role_key="from", text_key="value")


def _from_prompt(row: Mapping, where: str) -> list[dict]:
    key = "prompt" if "prompt" in row else "instruction"
    prompt = row.get(key)
    if isinstance(prompt, list):
        messages = _message_list(prompt, key, where)
    elif isinstance(prompt, str):
        extra = row.get("input")
        text = f"{prompt}\n\n{extra}" if isinstance(extra, str) and extra.strip() else prompt
        messages = [{"role": "user", "content": text}]
        if isinstance(row.get("system"), str) and row["system"].strip():
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise DataError(f"{_label(where)}: '{key}' must be text or a list of messages")
    for response_key in RESPONSE_KEYS:
        response = row.get(response_key)
        if isinstance(response, list):
            return messages + _message_list(response, response_key, where)
        if response is not None:
            return messages + [{"role": "assistant", "content": _content(response, where)}]
    return messages


def _from_mtbench(row: Mapping, where: str) -> list[dict]:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise DataError(f"{_label(where)}: 'turns' must be a non-empty list of strings")
    # Later turns answer a reply we do not have; callers that want them read row["turns"].
    return [{"role": "user", "content": turns[0]}]


_PARSERS = {
    "openai": _from_openai,
    "sharegpt": _from_sharegpt,
    "prompt": _from_prompt,
    "mtbench": _from_mtbench,
}
_DETECT = (
    ("messages", "openai"),
    ("conversations", "sharegpt"),
    ("turns", "mtbench"),
    ("prompt", "prompt"),
    ("instruction", "prompt"),
)


def to_messages(row: Mapping, fmt: str = "auto", *, where: str = "") -> list[dict]:
    """Normalize one chat row to ``[{"role": ..., "content": ...}]``.

    Args:
        row: a ShareGPT (``conversations``), OpenAI (``messages``), prompt (``prompt`` or
            ``instruction``, optional ``input``, ``system`` and ``response``/``output``/
            ``completion``) or MT-bench (``turns``: first turn only) row.
        fmt: one of :data:`FORMATS`; ``"auto"`` picks by the keys present.
        where: names the row in errors, e.g. ``"prompts.jsonl row 7"``.

    Raises:
        DataError: the row has no recognized shape or a malformed message.
    """
    if not isinstance(row, Mapping):
        raise DataError(f"{_label(where)}: expected an object, got {type(row).__name__}")
    if fmt == "auto":
        fmt = next((name for key, name in _DETECT if key in row), "")
        if not fmt:
            expected = ", ".join(repr(key) for key, _ in _DETECT)
            raise DataError(
                f"{_label(where)}: unrecognized chat row; expected one of {expected},"
                f" found keys {sorted(row)}"
            )
    if fmt not in _PARSERS:
        raise ConfigError(f"unknown chat format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _PARSERS[fmt](row, where)


def prompt_messages(messages: list[dict], *, where: str = "") -> list[dict]:
    """The context a target answers: messages before the first assistant turn (without one,
    through the first user turn).

    Raises:
        DataError: there is no user message in that context.
    """
    roles = [m["role"] for m in messages]
    if "assistant" in roles:
        cut = roles.index("assistant")
    else:
        cut = roles.index("user") + 1 if "user" in roles else len(roles)
    prompt = [dict(m) for m in messages[:cut]]
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{_label(where)}: no user message before the first assistant turn")
    return prompt


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as err:
        raise DataError(f"{_label(where)}: the chat template rejected it: {err}") from None


def assistant_spans(
    messages: list[dict], tokenizer, *, where: str = ""
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and find the character span of every assistant turn.

    Returns:
        The rendered text and, per assistant turn, ``(start, end)`` offsets into it: from the
        end of the generation prompt to the end of the turn's closing tokens (trailing
        whitespace after them excluded, since generation stops at the end-of-turn token).

    Raises:
        DataError: the template is not prefix-stable (a shorter conversation does not render
            as a prefix of the full one), so turns cannot be located.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    text = _render(tokenizer, messages, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], True, where)
        turn = _render(tokenizer, messages[: i + 1], False, where)
        if not (text.startswith(head) and text.startswith(turn) and len(head) <= len(turn)):
            raise DataError(
                f"{_label(where)}: the chat template is not prefix-stable (rendering the first"
                f" {i} messages is not a prefix of the whole chat), cannot mask assistant turn {i}"
            )
        start = len(head)
        spans.append((start, start + len(text[start : len(turn)].rstrip())))
    return text, spans


def tokenize_chat(
    messages: list[dict],
    tokenizer,
    max_length: int,
    overflow: str = "truncate",
    *,
    where: str = "",
) -> dict | None:
    """Token ids and an assistant-only loss mask for one conversation.

    Args:
        messages: OpenAI-style messages (see :func:`to_messages`).
        tokenizer: a fast tokenizer with a chat template (offsets are needed).
        max_length: most tokens kept.
        overflow: ``"truncate"`` cuts to ``max_length``; ``"drop"`` returns ``None`` instead.

    Returns:
        ``{"input_ids": [T], "loss_mask": [T]}`` where ``loss_mask[t] == 1`` when
        ``input_ids[t]`` belongs to an assistant turn (so the prediction made at ``t - 1`` is
        scored), or ``None`` when dropped.
    """
    ids, mask = _encode(messages, tokenizer, where)
    return _fit(ids, mask, max_length, overflow)


def _encode(messages: list[dict], tokenizer, where: str) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(messages, tokenizer, where=where)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ModelError("assistant masks need a fast tokenizer (offset mappings)") from None
    mask = []
    for a, b in enc["offset_mapping"]:
        b = max(b, a + 1)  # a zero-width token counts where it sits
        mask.append(int(any(a < end and b > start for start, end in spans)))
    return list(enc["input_ids"]), mask


def _check_overflow(overflow: str) -> None:
    if overflow not in OVERFLOW:
        raise ConfigError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")


def _fit(ids: list[int], mask: list[int], max_length: int, overflow: str) -> dict | None:
    _check_overflow(overflow)
    if len(ids) > max_length:
        if overflow == "drop":
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


@dataclass
class SFTStats:
    """What :func:`build_sft_dataset` did with each row.

    Attributes:
        kept: rows in the dataset (truncated ones included).
        truncated: kept rows cut to ``max_length``.
        dropped: rows over ``max_length`` with ``overflow="drop"``, or with no assistant
            token left after truncation.
        no_assistant: rows without an assistant turn, skipped.
    """

    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    no_assistant: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def build_sft_dataset(
    rows: Iterable[Mapping] | Dataset,
    tokenizer,
    max_length: int,
    overflow: str = "truncate",
    require_assistant: bool = False,
    *,
    source: str = "data",
    fmt: str = "auto",
    carry: tuple[str, ...] = (),
) -> tuple[Dataset, SFTStats]:
    """Tokenize chat rows into a dataset of ``input_ids`` and ``loss_mask`` columns.

    Args:
        rows: chat rows in any shape :func:`to_messages` reads.
        tokenizer: the target's tokenizer, chat template included.
        max_length: most tokens per row.
        overflow: ``"truncate"`` or ``"drop"`` rows longer than ``max_length``.
        require_assistant: a row without an assistant turn is an error instead of skipped.
        source: names the data in messages, e.g. the file name.
        fmt: row format, see :data:`FORMATS`.
        carry: fields of each row copied into columns of the same name (e.g. where a row
            came from).

    Returns:
        The dataset and the per-row counts (also logged).

    Raises:
        DataError: a malformed row, a row without an assistant turn when
            ``require_assistant``, or no usable row at all.
    """
    _check_overflow(overflow)
    if max_length < 1:
        raise ConfigError(f"max_length must be positive, got {max_length}")
    stats = SFTStats()
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], **{c: [] for c in carry}}
    for i, row in enumerate(rows, start=1):
        where = f"{source} row {i}"
        messages = to_messages(row, fmt, where=where)
        if not any(m["role"] == "assistant" for m in messages):
            if require_assistant:
                raise DataError(f"{where}: no assistant turn to train on")
            stats.no_assistant += 1
            continue
        ids, mask = _encode(messages, tokenizer, where)
        fitted = _fit(ids, mask, max_length, overflow)
        if fitted is None or not any(fitted["loss_mask"]):
            stats.dropped += 1
            continue
        stats.truncated += len(fitted["input_ids"]) < len(ids)
        stats.kept += 1
        columns["input_ids"].append(fitted["input_ids"])
        columns["loss_mask"].append(fitted["loss_mask"])
        for c in carry:
            columns[c].append(row[c])
    summary = ", ".join(f"{k} {v}" for k, v in stats.as_dict().items())
    if stats.kept == 0:
        raise DataError(f"{source}: no usable rows ({summary})")
    lossy = stats.dropped + stats.no_assistant + stats.truncated
    level = logging.WARNING if lossy else logging.INFO
    logger.log(level, "%s: %s (max_length %d)", source, summary, max_length)
    return Dataset.from_dict(columns), stats
