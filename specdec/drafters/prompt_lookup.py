"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the last n-gram.

Training-free (Saxena 2023, "Prompt Lookup Decoding"; the n-gram proposer of vLLM and
transformers): summaries, code edits and multi-turn chats repeat spans of their context, and
where the last few tokens occurred before, the tokens after them are a cheap, deterministic
guess. It is the bar every trained drafter must clear.
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

    def check(self) -> None:
        if self.max_ngram < self.min_ngram:
            message = f"expected >= drafter.min_ngram ({self.min_ngram}), got {self.max_ngram}"
            raise Invalid("drafter.max_ngram", message, also=["drafter.min_ngram"])


class PromptLookupDrafter(Drafter):
    """Deterministic n-gram drafter over the prompt and the output so far.

    Args:
        max_ngram: longest suffix tried first.
        min_ngram: shortest suffix still trusted.
    """

    name = "prompt_lookup"
    config_class = PromptLookupConfig

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @classmethod
    def build(cls, target, cfg: PromptLookupConfig, token_counts=None) -> PromptLookupDrafter:
        """Training-free: nothing to build but the n-gram bounds."""
        return cls(cfg.max_ngram, cfg.min_ngram)

    @classmethod
    def from_checkpoint(cls, path, target) -> PromptLookupDrafter:
        from specdec.errors import ModelError

        raise ModelError(f"{path}: prompt lookup has no trained checkpoints to load")

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        ids = torch.as_tensor(sequence, dtype=torch.long)
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows starting at 0 .. length-n-1: every earlier occurrence, not the suffix itself
            windows = ids[:-1].unfold(0, n, 1)
            hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return Proposal(ids[start : start + k])
        return Proposal(ids[:0])
