"""Chain verification: which drafted tokens the target accepts, and the token it adds.

Greedy: the longest prefix of the draft equal to the target's argmax, then the target's own
argmax at the first mismatch (or after the last draft token: the bonus token).

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): draft token x_i drawn
from q_i is accepted with probability min(1, p_i(x)/q_i(x)); at the first rejection the
replacement is drawn from norm(max(0, p_i - q_i)); if every draft token is accepted, a bonus
token is drawn from p_{k+1}. The emitted tokens are then distributed exactly as the target's.
A deterministic draft (no q) is the one-hot q = e_x.
"""

from __future__ import annotations

import torch

from specdec.decoding.sampling import sample


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy verification.

    Args:
        draft: ``[k]`` drafted token ids.
        target_logits: ``[k + 1, V]``; row i is the target's prediction after draft[:i].

    Returns:
        ``(n, tokens)``: the number of accepted draft tokens and the ``n + 1`` emitted tokens.
    """
    best = target_logits.argmax(dim=-1)  # [k + 1]
    k = draft.shape[0]
    n = (draft == best[:k]).to(torch.long).cumprod(dim=0).sum()
    # one host transfer per round: the count, the draft and the target's choices
    host = torch.cat([n.view(1), draft, best]).tolist()
    n = host[0]
    return n, host[1 : 1 + n] + [host[1 + k + n]]


def verify_sampling(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, list[int]]:
    """Lossless speculative sampling.

    Args:
        draft: ``[k]`` drafted token ids.
        q: ``[k, V]`` the distributions the draft tokens were drawn from, or None when the
            draft is deterministic (one-hot q).
        p: ``[k + 1, V]`` the target's processed distributions (same temperature/top-k/top-p).
        generator: source of randomness for the accept test and the resampling.

    Returns:
        ``(n, tokens)``: the number of accepted draft tokens and the ``n + 1`` emitted tokens.
    """
    k = draft.shape[0]
    if k:
        rows = torch.arange(k, device=p.device)
        p_x = p[rows, draft]
        q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)
        u = torch.rand(k, device=p.device, generator=generator)
        # accept iff u < p/q, written without dividing (q_x > 0 for a drawn token)
        accepted = (u * q_x < p_x).to(torch.long)
        n = int(accepted.cumprod(dim=0).sum())
    else:
        n = 0
    if n == k:
        nxt = sample(p[k], generator)
    else:
        nxt = sample(residual(p[n], q[n] if q is not None else None, draft[n]), generator)
    return n, draft[:n].tolist() + [int(nxt)]


def residual(p: torch.Tensor, q: torch.Tensor | None, drafted: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); for a one-hot q that is p with the drafted token removed."""
    if q is None:
        rest = p.clone()
        rest[drafted] = 0.0
    else:
        rest = (p - q).clamp_min(0.0)
    total = rest.sum()
    # A rejection has probability 1 - sum(min(p, q)) = sum(rest); a zero residual can only
    # be reached through rounding (p == q), where p itself is the correct fallback.
    return rest / total if total > 0 else p
