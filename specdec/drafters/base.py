"""The interface every drafter family offers the decoder.

Decoding face: ``begin`` on a prompt, ``propose`` up to k tokens after the current sequence
(with the exact distributions they were drawn from, or none for a deterministic draft), and
``commit`` what the target accepted so the drafter's own state (KV cache, features) stays in
step. A drafter may work over a reduced vocabulary internally; the distributions it returns
are always over the target's vocabulary (zero outside its own), which keeps rejection
sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.decoding.sampling import SamplingParams


@dataclass
class Proposal:
    """Drafted tokens.

    Attributes:
        tokens: ``[n]`` token ids, n <= k (n may be 0: nothing worth proposing).
        probs: ``[n, V]`` the distributions the tokens were drawn from (target vocabulary),
            or None when the draft is deterministic (greedy drafting, n-gram lookup).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter:
    """Base class of the decoding face. Subclasses implement ``propose``."""

    name: str = "drafter"
    #: decoder-layer indices of the target whose outputs the drafter consumes
    required_target_layers: tuple[int, ...] = ()

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        """Start a new sequence. ``target_features`` holds the requested target layers'
        outputs over the prompt (``{layer: [T, H]}``)."""

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Propose up to ``k`` tokens to follow ``sequence`` (prompt and output so far)."""
        raise NotImplementedError

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        """The target accepted ``num_accepted`` tokens of the last proposal and added one of
        its own. ``target_features`` covers the positions newly in the target's cache."""

    @classmethod
    def from_checkpoint(cls, path: str, target) -> Drafter:
        """Load a trained drafter saved by specdec for ``target`` (a FrozenTarget)."""
        from specdec.errors import ModelError

        raise ModelError(f"{path}: drafter '{cls.name}' has no trained checkpoints to load")

    @property
    def draft_seconds(self) -> float:
        """Seconds this drafter spent in model forwards (0 for model-free drafters)."""
        return 0.0
