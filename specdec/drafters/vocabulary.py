"""Reduced draft vocabularies, shared by every family that predicts fewer tokens than the target.

On a small target the LM head is a large share of a draft step (SmolLM2-135M: 49,152 x 576),
so drafters predict only the D most frequent target tokens of the training answers (EAGLE-3,
Li et al. 2025; FR-Spec). A draft vocabulary is ``draft_ids``: ``[D]`` target token ids,
sorted. Serving engines store the same map two ways, both derived here:

- ``d2t``: ``[D]`` offsets, ``target_id = i + d2t[i]`` (SpecForge, speculators, SGLang);
- ``t2d``: ``[V]`` booleans, true at target ids the draft can emit.

A draft distribution over D tokens maps back onto the target's vocabulary with zeros elsewhere
(:func:`to_target`), which keeps rejection sampling exact: q is exactly what was sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.errors import ConfigError


def special_ids(target) -> list[int]:
    """Tokens a reduced vocabulary always keeps: special and added-special tokens, EOS ids."""
    tok = target.tokenizer
    ids = set(tok.all_special_ids)
    ids |= {i for i, added in tok.added_tokens_decoder.items() if added.special}
    eos = target.model.generation_config.eos_token_id
    ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(i for i in ids if i < target.vocab_size)


def select_vocab(token_counts: torch.Tensor, size: int, keep: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent tokens, ``keep`` always among them.

    Args:
        token_counts: ``[V]`` counts per target token id.
        size: D, the reduced vocabulary size.
        keep: token ids included whatever their count.

    Returns:
        ``[D]`` target ids sorted by id (ties in count go to the lower id).
    """
    if len(keep) > size:
        raise ConfigError(
            f"drafter.draft_vocab_size: {size} is smaller than the {len(keep)} special tokens "
            "that a drafter must be able to emit"
        )
    score = token_counts.detach().to("cpu", torch.float64).clone()
    score[list(keep)] = float("inf")
    order = torch.argsort(score, descending=True, stable=True)
    return order[:size].sort().values


def draft_vocab(target, size: int | None, token_counts: torch.Tensor | None) -> torch.Tensor | None:
    """The draft vocabulary a recipe asks for: None for the full one.

    Raises:
        ValueError: a reduced vocabulary without ``token_counts``.
    """
    if size is None or size >= target.vocab_size:
        return None
    if token_counts is None:
        raise ValueError("a reduced draft vocabulary needs token_counts from the training data")
    return select_vocab(token_counts, size, special_ids(target))


def d2t(draft_ids: torch.Tensor) -> torch.Tensor:
    """``[D]`` offsets with ``target_id = i + d2t[i]``."""
    return draft_ids - torch.arange(len(draft_ids), device=draft_ids.device)


def t2d(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` booleans: true at the target ids the draft can emit."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    mask[draft_ids] = True
    return mask


def from_d2t(offsets: torch.Tensor) -> torch.Tensor:
    """``draft_ids`` back from ``d2t`` offsets."""
    return offsets + torch.arange(len(offsets), device=offsets.device)


def to_target(q: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft distributions ``[n, D]`` as target distributions ``[n, V]`` (zero elsewhere)."""
    if draft_ids is None:
        return q
    full = q.new_zeros(q.shape[0], vocab_size)
    return full.index_copy_(1, draft_ids.to(q.device), q)


def token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """How often each target token is an assistant token: picks a reduced draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        kept = torch.tensor([t for t, m in zip(ids, mask, strict=True) if m], dtype=torch.long)
        counts += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    return counts
