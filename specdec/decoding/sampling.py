"""Turning logits into the distributions that speculative sampling compares.

Speculative sampling is exact only if the target's p and the drafter's q are both the
*processed* distributions actually sampled from (temperature, top-k and top-p applied the same
way to both); transformers shipped two bugs of exactly this kind. Everything that turns logits
into probabilities in specdec goes through :func:`probabilities`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set whose probability reaches top_p; 1.0 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from, after temperature, top-k and top-p.

    Args:
        logits: ``[..., V]`` raw logits.
        params: the sampling settings; must not be greedy.

    Returns:
        ``[..., V]`` float32 probabilities, zero outside the kept set.
    """
    if params.greedy:
        raise ValueError("probabilities() needs temperature > 0; greedy decoding uses argmax")
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p: the most likely
        # token always survives, and the kept set is the smallest reaching top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` (``[..., V]`` -> ``[...]``)."""
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator)
    return drawn.reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Pick the next token from ``[V]`` logits: argmax when greedy, else a draw from p."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probabilities(logits, params), generator)
