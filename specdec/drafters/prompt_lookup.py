"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the last n-gram.

Training-free (Saxena 2023, "Prompt Lookup Decoding"; the n-gram proposer of vLLM and
transformers): summaries, code edits and multi-turn chats repeat spans of their context, and
where the last few tokens occurred before, the tokens after them are a cheap, deterministic
guess. It is the bar every trained drafter must clear.

How far to copy: a copy of k tokens costs a verify of k + 1 positions, which is cheap up to a
few tokens and then grows (on a 2-core CPU SmolLM2-135M verifies 5 tokens for 1.5 and 13 for
1.9 target steps). Inside a long repeated span (an extraction, code rewritten from the
prompt) copies run on for dozens of tokens; elsewhere they break within a few. So a copy is
``copy_start`` tokens long at first, twice as long after each copy the target accepted
whole, up to the round's k, and back to ``copy_start`` after any other round (a copy cut
short, or a round without one). transformers' assisted generation schedules its draft
length likewise, 2 tokens up after a draft accepted whole and 1 down otherwise. Each round's
length depends only on earlier rounds, so decoding stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config.schema import DrafterConfig, option
from specdec.config.validation import Invalid
from specdec.decoding.sampling import SamplingParams
from specdec.drafters.base import Drafter, Proposal


@dataclass
class PromptLookupConfig(DrafterConfig):
    type: str = option("prompt_lookup", "Drafter family (registry name).")
    max_ngram: int = option(3, "Longest n-gram matched in the context.", ge=1)
    min_ngram: int = option(1, "Shortest n-gram matched in the context.", ge=1)
    copy_start: int = option(
        4, "Tokens copied at first and after a round whose copy the target did not accept "
        "whole; each copy accepted whole doubles it, up to the round's k (0: always k).", ge=0,
    )  # fmt: skip

    def check(self) -> None:
        if self.max_ngram < self.min_ngram:
            message = f"expected >= drafter.min_ngram ({self.min_ngram}), got {self.max_ngram}"
            raise Invalid("drafter.max_ngram", message, also=["drafter.min_ngram"])


class PromptLookupDrafter(Drafter):
    """Deterministic n-gram drafter over the prompt and the output so far.

    Args:
        max_ngram: longest suffix tried first.
        min_ngram: shortest suffix still trusted.
        copy_start: tokens copied at first and after any round but a copy accepted whole,
            which doubles it (up to the round's k); 0: always k.

    Attributes:
        copy_length: the longest copy of the next round before k caps it.
    """

    name = "prompt_lookup"
    config_class = PromptLookupConfig

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, copy_start: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if copy_start < 0:
            raise ValueError(f"copy_start must be >= 0 (0: always k), got {copy_start}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.copy_start = copy_start
        self.begin(())

    @classmethod
    def build(cls, target, cfg: PromptLookupConfig, token_counts=None) -> PromptLookupDrafter:
        """Training-free: nothing to build but the n-gram bounds."""
        return cls(cfg.max_ngram, cfg.min_ngram, cfg.copy_start)

    @classmethod
    def from_checkpoint(cls, path, target) -> PromptLookupDrafter:
        from specdec.errors import ModelError

        raise ModelError(f"{path}: prompt lookup has no trained checkpoints to load")

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        self.copy_length = self.copy_start or None
        self._copied, self._k = 0, 0

    def limit(self, k: int) -> int:
        """How many tokens this round's copy may take, given the round's k."""
        return k if self.copy_length is None else min(k, self.copy_length)

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        ids = torch.as_tensor(sequence, dtype=torch.long)
        length, limit = ids.shape[0], self.limit(k)
        self._copied, self._k = 0, k
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows starting at 0 .. length-n-1: every earlier occurrence, not the suffix itself
            windows = ids[:-1].unfold(0, n, 1)
            hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                copy = ids[start : start + limit]
                self._copied = len(copy)
                return Proposal(copy)
        return Proposal(ids[:0])

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        """A copy accepted whole doubles the next one's length (up to this round's k); any
        other round starts it over."""
        if self.copy_length is not None:
            whole = self._copied > 0 and num_accepted >= self._copied
            grown = min(2 * self.copy_length, self._k)
            self.copy_length = max(self.copy_start, grown) if whole else self.copy_start
        self._copied = 0
