"""Prompt lookup where the context has something to copy, a trained drafter everywhere else.

Prompt lookup (:mod:`specdec.drafters.prompt_lookup`) costs nothing and, on text that repeats
its context (summaries, code edits, multi-turn chats), is often right for many tokens; a
trained drafter (a draft model, EAGLE-3) costs forwards but has a guess everywhere. The hybrid
asks prompt lookup first and takes its continuation when it is at least ``min_match`` tokens
long, and the inner drafter's proposal otherwise: the selection by match length of SAM
Decoding (Hu et al. 2024, "SAM Decoding: Speculative Decoding via Suffix Automaton"), with
prompt lookup's own matching rule (the latest occurrence of the longest suffix n-gram). Its
copies grow while the target accepts them whole (prompt lookup's ``copy_start``) and the
inner drafter's rounds start them over, so k can be large: the inner drafter's confidence
stop ends its own chains.

How long a match must be is prompt lookup's ``min_ngram`` (:func:`specdec.drafters.hybrid`
sets it to ``HYBRID_MIN_NGRAM`` unless told). After a one-token match a copied token is no
likelier than a trained head's guess; after three tokens it is far likelier (README, "Where
the EAGLE-3 head misses, and the hybrid"; ``bench/draft_misses.py``).

Exactness: which drafter proposes is decided from the sequence alone, before anything is
drawn, so every round is an ordinary speculative step with that drafter's draft and its own
q (prompt lookup's is deterministic: ``probs=None``, a one-hot q). Greedy decoding stays
token-identical to plain decoding and sampling stays lossless.

Keeping the inner drafter in step: the decoder commits every round, and the hybrid forwards
every commit to the inner drafter, also of rounds that prompt lookup drafted. That is the
contract of :meth:`Drafter.commit`: a drafter advances its state with the target's features
of the kept positions and the next ``propose``'s sequence, never by assuming that its own last
draft was the one verified. EAGLE-3 drops its own draft entries (already gone when it did not
draft) and queues the features, which the next ``propose`` enters all at once; a draft model
re-syncs its KV cache with the sequence by prefix in ``propose`` and feeds what it has not
seen, the tokens prompt lookup got accepted included, in one forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from specdec.decoding.sampling import SamplingParams
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.prompt_lookup import PromptLookupDrafter


class HybridDrafter(Drafter):
    """Prompt lookup's continuation when it is long enough, else ``inner``'s proposal.

    Args:
        lookup: the n-gram drafter asked first.
        inner: the drafter asked when prompt lookup finds no continuation of ``min_match``
            tokens (any family; :meth:`configure` sets its knobs, and chains: the hybrid
            drafts no trees).
        min_match: the shortest continuation of prompt lookup worth proposing (capped at the
            round's copy length: a one-token budget takes a one-token match).

    Attributes:
        rounds_by_source: ``{drafter name: rounds it drafted}``, over every sequence so far.
        accepted_by_source: ``{drafter name: draft tokens of its rounds the target accepted}``.
    """

    branches = False

    def __init__(self, lookup: PromptLookupDrafter, inner: Drafter, min_match: int = 2):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.lookup, self.inner, self.min_match = lookup, inner, min_match
        self.name = f"{lookup.name}+{inner.name}"
        self.rounds_by_source: Counter[str] = Counter()
        self.accepted_by_source: Counter[str] = Counter()
        self._round: tuple[str, int] | None = None  # (source, drafted) of the round in flight

    # the inner drafter's knobs and needs are the hybrid's (prompt lookup has none)
    @property
    def required_target_layers(self) -> tuple[int, ...]:
        return self.inner.required_target_layers

    @property
    def forward(self) -> str | None:
        return self.inner.forward

    @property
    def confidence(self) -> float | None:
        return self.inner.confidence

    @property
    def draft_seconds(self) -> float:
        return self.inner.draft_seconds

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        """The inner drafter's forward and confidence stop; a tree is refused (chains only)."""
        super().configure(forward, confidence, tree)
        self.inner.configure(forward, confidence, None)

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        self.lookup.begin(prompt, target_features)
        self.inner.begin(prompt, target_features)
        self._round = None

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        proposal = self.lookup.propose(sequence, k, params, generator)
        source = self.lookup.name
        if len(proposal) < min(self.min_match, self.lookup.limit(k)):
            proposal = self.inner.propose(sequence, k, params, generator)
            source = self.inner.name
        self.rounds_by_source[source] += 1
        self._round = (source, len(proposal))
        return proposal

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        copied = 0  # what prompt lookup's copy length follows: its own rounds only
        if self._round is not None:  # None: a round without a proposal (no budget left)
            source, drafted = self._round
            self.accepted_by_source[source] += min(num_accepted, drafted)  # padding excluded
            copied = num_accepted if source == self.lookup.name else 0
        self._round = None
        self.lookup.commit(copied)
        self.inner.commit(num_accepted, target_features)
