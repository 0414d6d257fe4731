"""An independent small causal LM as the drafter (Leviathan et al. 2023; DistillSpec, Zhou et
al. 2024, for training it against the target).

Decoding face: the draft model keeps its own KV cache (a :class:`ModelSession`), re-syncs it
with the accepted sequence by prefix, and drafts k tokens autoregressively, returning the exact
distributions it sampled from. An optional reduced output vocabulary (``vocab_map``: draft
output index -> target token id) makes its LM head cheap; its q is scattered back onto the
target vocabulary, zero elsewhere, so rejection sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.decoding.sampling import SamplingParams, probabilities, sample
from specdec.decoding.session import ModelSession
from specdec.drafters.base import Drafter, Proposal


class DraftModelDrafter(Drafter):
    """Drafts with a small causal LM that reads target token ids.

    Args:
        model: a transformers causal LM whose input vocabulary is the target's.
        target_vocab_size: size of the target's output distribution.
        vocab_map: ``[D]`` target ids of the draft's D output logits, or None when the draft
            predicts the full target vocabulary.
    """

    name = "draft_model"

    def __init__(self, model, target_vocab_size: int, vocab_map: torch.Tensor | None = None):
        self.model = model.eval()
        self.session = ModelSession(self.model)
        self.target_vocab_size = target_vocab_size
        self.vocab_map = None if vocab_map is None else vocab_map.to(self.session.device)

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        self.session.reset()

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        logits = self.session.extend(self.session.sync(sequence), last_only=True)[-1]
        tokens, dists = [], []
        for i in range(k):
            if self.vocab_map is None:
                logits = _fit(logits, self.target_vocab_size)
            if params.greedy:
                choice = logits.argmax(dim=-1)
            else:
                q = probabilities(logits, params)
                choice = sample(q, generator)
                dists.append(q)
            token = choice if self.vocab_map is None else self.vocab_map[choice]
            tokens.append(token)
            if i + 1 < k:
                logits = self.session.extend(token.view(1))[-1]
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)
        return Proposal(draft, self._to_target_vocab(dists) if dists else None)

    def _to_target_vocab(self, dists: list[torch.Tensor]) -> torch.Tensor:
        q = torch.stack(dists)  # [k, D]
        if self.vocab_map is None:
            return q
        full = q.new_zeros(q.shape[0], self.target_vocab_size)
        return full.index_copy_(1, self.vocab_map, q)

    @property
    def draft_seconds(self) -> float:
        return self.session.forward_seconds


def _fit(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Match the target's logit width: models of one tokenizer may pad their vocabularies
    differently; padded rows are never real tokens."""
    if logits.shape[-1] >= size:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))
