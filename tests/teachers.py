"""A drafter's teacher laid back out on the batch's grid, for tests that check it position by
position against the target's logits."""

from __future__ import annotations

import torch


def grid(teacher, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``s``'s targets at their positions: ``[B, T, D]`` log-probabilities (NaN where step
    s trains nothing) and ``[B, T]`` draft-vocabulary tokens (-2 there)."""
    log_p, tokens = teacher.at(s)
    where = teacher.mask[s]
    out_p = log_p.new_full((*where.shape, log_p.shape[-1]), float("nan"))
    out_t = tokens.new_full(where.shape, -2)
    out_p[where], out_t[where] = log_p, tokens
    return out_p, out_t
