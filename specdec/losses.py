"""Distillation losses between a drafter's and the target's next-token distributions.

Pure functions on logits and masks; no model code. Throughout, ``p`` is the frozen target's
distribution (the teacher) and ``q`` the drafter's (the student), both over the same vocabulary
``V`` (a caller with a reduced draft vocabulary restricts the target's logits beforehand).

Why several divergences: DistillSpec (Zhou et al., 2024, "DistillSpec: Improving Speculative
Decoding via Knowledge Distillation") shows that the best divergence depends on the task and
the decoding strategy, and that ``1 - TVD(p, q)`` is exactly the expected acceptance rate of
one draft token under speculative sampling, so total variation distance is both a loss and the
quantity a drafter is judged by. GKD (Agarwal et al., 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes") introduces the generalized Jensen-Shannon
divergence used here, which interpolates between forward and reverse KL.

All computation is in float32 whatever the input dtype, from ``log_softmax`` so that no
``log(0)`` appears; terms of the form ``0 * log 0`` count as 0. The target side is detached:
gradients reach the draft logits only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.sparse_teacher import SparseTeacher, scaled, sparse_forward_kl

LOSS_NAMES = ("forward_kl", "reverse_kl", "jsd", "tvd", "ce")


def token_losses(
    draft_logits: Tensor,
    target_logits: Tensor,
    *,
    name: str,
    temperature: float = 1.0,
    beta: float = 0.5,
    teacher_top_k: int | None = None,
    target_tokens: Tensor | None = None,
) -> Tensor:
    """Per-token loss of the drafter against the target, without reduction.

    Losses by ``name``:
        - ``forward_kl``: ``KL(p || q) = sum_v p (log p - log q)``, mass-covering.
        - ``reverse_kl``: ``KL(q || p)``, mode-seeking.
        - ``jsd``: the generalized JSD of GKD,
          ``beta * KL(p || m) + (1 - beta) * KL(q || m)`` with ``m = beta p + (1 - beta) q``.
          At ``beta = 0.5`` it is the symmetric JSD, bounded by ``log 2``. It vanishes as
          ``beta`` goes to 0 or 1, but ``jsd / beta -> KL(p || q)`` as ``beta -> 0`` and
          ``jsd / (1 - beta) -> KL(q || p)`` as ``beta -> 1``; the endpoints themselves are
          refused (use ``forward_kl`` / ``reverse_kl``), so ``0 < beta < 1``.
        - ``tvd``: ``0.5 * sum_v |p - q|``, in ``[0, 1]``; ``1 - tvd`` is the expected
          acceptance rate of one draft token.
        - ``ce``: hard cross-entropy ``-log q(y)`` of the draft on the target's own tokens
          ``y = target_tokens`` (argmax of the target logits when None). Negative ids (e.g.
          -100) give 0, like an ignore index.

    ``teacher_top_k`` keeps only the target's k largest logits and renormalizes, so ``p`` is 0
    elsewhere. Forward KL, JSD (``m >= (1 - beta) q > 0``), TVD and CE stay finite. Reverse KL
    would be infinite wherever the draft puts mass outside the top k, so that combination is
    refused rather than silently floored.

    No ``temperature**2`` gradient rescaling is applied; fold it into the mix weights if wanted.

    Args:
        draft_logits: drafter logits.  # [B, T, V]
        target_logits: target logits over the same vocabulary.  # [B, T, V]
        name: one of ``LOSS_NAMES``.
        temperature: divides both logits before the softmax; must be positive.
        beta: mixing weight of the generalized JSD (``jsd`` only), in ``(0, 1)``.
        teacher_top_k: keep only the target's top-k logits, renormalized; None keeps all.
        target_tokens: token ids for ``ce``, aligned with the logits positions.  # [B, T]

    Returns:
        The float32 loss at every position.  # [B, T]

    Raises:
        ValueError: unknown ``name``, mismatched shapes, or an invalid setting.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, teacher_top_k)
    if name == "ce" and target_tokens is None:
        target_tokens = target_logits.argmax(dim=-1)
    return _token_loss(name, log_q, log_p, beta, teacher_top_k, target_tokens)


def masked_mean(values: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """Sum of ``values`` over unmasked positions divided by ``num_tokens``.

    ``num_tokens`` lets a trainer divide by the global count of unmasked tokens across
    processes and gradient-accumulation steps: each micro-batch's loss is its local sum divided
    by that global count, so summing the losses of all micro-batches on all processes gives the
    global token mean exactly, however unevenly the tokens fall. Under DDP, which averages
    gradients over processes, multiply the loss by the number of processes (or pass
    ``global_count / num_processes``) to keep that sum.

    Masked positions are selected out (not multiplied by 0), so NaN or inf there never leaks.
    An all-masked batch gives 0, not NaN, still attached to the graph of ``values`` with a zero
    gradient.

    Args:
        values: per-token values.  # [B, T]
        mask: True / 1 where a position counts.  # [B, T]
        num_tokens: the divisor; ``mask.sum()`` when None. A zero divisor counts as 1.

    Returns:
        A scalar tensor.
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    keep = mask.bool()
    total = torch.where(keep, values, values.new_zeros(())).sum()
    if num_tokens is None:
        num_tokens = keep.sum()
    denom = torch.as_tensor(num_tokens, dtype=total.dtype, device=total.device)
    # Only an empty count is replaced: a fractional one (global_count / num_processes) is kept.
    return total / torch.where(denom > 0, denom, torch.ones_like(denom))


def distill_loss(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    *,
    mix: dict[str, float],
    temperature: float = 1.0,
    beta: float = 0.5,
    teacher_top_k: int | None = None,
    target_tokens: Tensor | None = None,
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of token losses, each reduced with :func:`masked_mean`.

    Args:
        draft_logits: drafter logits.  # [B, T, V]
        target_logits: target logits over the same vocabulary, or a :class:`SparseTeacher`
            (forward KL, and hard CE given ``target_tokens``, are computed from it directly;
            any other mix writes it out in full).
            # [B, T, V]
        mask: True / 1 where a position is trained on.  # [B, T]
        mix: loss name to weight, e.g. ``{"forward_kl": 1.0, "ce": 0.1}``; a weight of 0 still
            reports the loss as a metric.
        temperature: see :func:`token_losses`.
        beta: see :func:`token_losses`.
        teacher_top_k: see :func:`token_losses`.
        target_tokens: see :func:`token_losses`.  # [B, T]
        num_tokens: divisor for every term, see :func:`masked_mean`.

    Returns:
        ``(loss, parts)``: the scalar loss with its graph, and each name's masked mean,
        detached, normalised by the same divisor (so ``loss == sum(w * parts[n])``).
    """
    if not mix:
        raise ValueError("distill_loss needs at least one loss in mix")
    for name in mix:
        _check_name(name)
    if isinstance(target_logits, SparseTeacher):
        labelled = target_tokens is not None or "ce" not in mix
        if set(mix) <= {"forward_kl", "ce"} and teacher_top_k is None and labelled:
            teacher = target_logits

            def sparse_token_loss(name: str) -> Tensor:
                if name == "forward_kl":
                    return sparse_forward_kl(draft_logits, teacher, temperature)
                log_q = torch.log_softmax(scaled(draft_logits.float(), temperature), dim=-1)
                return _hard_ce(log_q, target_tokens)

            return _weighted(mix, sparse_token_loss, mask, num_tokens)
        target_logits = target_logits.dense()
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, teacher_top_k)
    if "ce" in mix and target_tokens is None:
        target_tokens = target_logits.argmax(dim=-1)

    def token_loss(name: str) -> Tensor:
        return _token_loss(name, log_q, log_p, beta, teacher_top_k, target_tokens)

    return _weighted(mix, token_loss, mask, num_tokens)


@torch.no_grad()
def top1_agreement(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> Tensor:
    """Fraction of unmasked positions where the draft's and target's argmaxes agree.

    This is the greedy acceptance rate of one draft token (``train/acc@1``).

    Args:
        draft_logits: drafter logits.  # [B, T, V]
        target_logits: target logits.  # [B, T, V]
        mask: True / 1 where a position counts.  # [B, T]

    Returns:
        A float32 scalar in ``[0, 1]`` (0 when every position is masked).
    """
    _check_shapes(draft_logits, target_logits)
    agree = draft_logits.argmax(dim=-1) == target_logits.argmax(dim=-1)
    return masked_mean(agree.float(), mask)


@torch.no_grad()
def expected_acceptance(
    draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """Mean of ``1 - TVD(p, q)`` over unmasked positions: the expected acceptance rate of one
    draft token under speculative sampling at ``temperature`` (DistillSpec).

    Args:
        draft_logits: drafter logits.  # [B, T, V]
        target_logits: target logits.  # [B, T, V]
        mask: True / 1 where a position counts.  # [B, T]
        temperature: sampling temperature of both models; must be positive.

    Returns:
        A float32 scalar in ``[0, 1]`` (0 when every position is masked).
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, None)
    return masked_mean(1.0 - _tvd(log_q, log_p), mask)


@torch.no_grad()
def acceptance_rate(draft_logits: Tensor, target_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``sum_v min(p(v), q(v))`` over unmasked positions, with ``p`` the target's
    full-vocabulary distribution read at the draft's tokens (not renormalised: the target's
    mass outside them can never be accepted) and ``q`` the draft's: the expected acceptance of
    one sampled draft token at temperature 1 (``train/expected_accept``).

    Args:
        draft_logits: drafter logits.  # [B, T, D]
        target_log_probs: the target's log-probabilities at the draft's tokens, or a
            :class:`SparseTeacher` of them.  # [B, T, D]
        mask: True / 1 where a position counts.  # [B, T]
    """
    q = torch.softmax(draft_logits.float(), dim=-1)
    if not isinstance(target_log_probs, SparseTeacher):
        return masked_mean(torch.minimum(target_log_probs.float().exp(), q).sum(dim=-1), mask)
    # every token at the shared value, then the k kept tokens corrected to their own
    t = target_log_probs
    p_fill = t.fill.float().exp()
    overlap = torch.minimum(q, p_fill[..., None]).sum(dim=-1)
    q_kept = q.gather(-1, t.cols)
    own = torch.minimum(t.values.float().exp(), q_kept) - torch.minimum(p_fill[..., None], q_kept)
    overlap = overlap + torch.where(t.used, own, 0.0).sum(dim=-1)
    return masked_mean(overlap, mask)


def teacher_mass(target_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Mean over unmasked positions of the probability the target puts on the draft's tokens
    (``train/teacher_mass``): what no draft can reach is one minus it. From a top-k cache it is
    the read-back's (the tail spread evenly), exact to within that cache's total variation.

    Args:
        target_log_probs: the target's full-vocabulary log-probabilities read at the draft's
            tokens, or a :class:`SparseTeacher` of them.  # [B, T, D]
        mask: True / 1 where a position counts.  # [B, T]
    """
    if isinstance(target_log_probs, SparseTeacher):
        return masked_mean(target_log_probs.log_mass().exp(), mask)
    return masked_mean(torch.logsumexp(target_log_probs.float(), dim=-1).exp(), mask)


def _weighted(
    mix: dict[str, float], token_loss, mask: Tensor, num_tokens: Tensor | float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(sum_n w_n * masked_mean(token_loss(n)), each masked mean detached)`` over ``mix``."""
    loss, parts = torch.zeros((), device=mask.device), {}
    for name, weight in mix.items():
        value = masked_mean(token_loss(name), mask, num_tokens)
        loss = loss + weight * value
        parts[name] = value.detach()
    return loss, parts


def _check_name(name: str) -> None:
    if name not in LOSS_NAMES:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(LOSS_NAMES)}")


def _check_shapes(draft_logits: Tensor, target_logits: Tensor) -> None:
    if draft_logits.shape != target_logits.shape or draft_logits.dim() != 3:
        raise ValueError(
            f"draft logits {tuple(draft_logits.shape)} and target logits "
            f"{tuple(target_logits.shape)} must both be [B, T, V] with the same V"
        )


def _log_probs(
    draft_logits: Tensor, target_logits: Tensor, temperature: float, teacher_top_k: int | None
) -> tuple[Tensor, Tensor]:
    """float32 log-probabilities ``(log q, log p)``; the target side carries no gradient."""
    _check_shapes(draft_logits, target_logits)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    draft = scaled(draft_logits.float(), temperature)
    target = scaled(target_logits.detach().float(), temperature)
    if teacher_top_k is not None:
        if teacher_top_k < 1:
            raise ValueError(f"teacher_top_k must be at least 1, got {teacher_top_k}")
        if teacher_top_k < target.shape[-1]:
            values, indices = target.topk(teacher_top_k, dim=-1)
            target = torch.full_like(target, -math.inf).scatter(-1, indices, values)
    return F.log_softmax(draft, dim=-1), F.log_softmax(target, dim=-1)


def _token_loss(
    name: str,
    log_q: Tensor,
    log_p: Tensor,
    beta: float,
    teacher_top_k: int | None,
    target_tokens: Tensor | None,
) -> Tensor:
    _check_name(name)
    if name == "forward_kl":
        return _kl(log_p, log_q)
    if name == "reverse_kl":
        if teacher_top_k is not None:
            raise ValueError(
                "reverse_kl with teacher_top_k is infinite wherever the draft puts mass outside "
                "the target's top k; use forward_kl or jsd, or drop teacher_top_k"
            )
        return _kl(log_q, log_p)
    if name == "jsd":
        return _jsd(log_q, log_p, beta)
    if name == "tvd":
        return _tvd(log_q, log_p)
    return _hard_ce(log_q, target_tokens)


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``KL(a || b)`` per position, with ``0 * log 0 = 0`` where ``a`` has no mass."""
    a = log_a.exp()
    # Select before multiplying so that -inf logits give neither NaN values nor NaN gradients.
    diff = torch.where(a > 0, log_a - log_b, a.new_zeros(()))
    return (a * diff).sum(dim=-1)


def _jsd(log_q: Tensor, log_p: Tensor, beta: float) -> Tensor:
    if not 0.0 < beta < 1.0:
        raise ValueError(
            f"jsd needs 0 < beta < 1, got {beta}; use forward_kl (beta -> 0) or "
            "reverse_kl (beta -> 1) for the limits"
        )
    # log m = logsumexp(log beta p, log (1 - beta) q). The floor keeps its backward free of
    # NaN where both sides are -inf; it changes nothing else since exp(-1e30) is 0 already.
    mixed = torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]).clamp(min=-1e30)
    log_m = torch.logsumexp(mixed, dim=0)
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def _tvd(log_q: Tensor, log_p: Tensor) -> Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)


def _hard_ce(log_q: Tensor, target_tokens: Tensor | None) -> Tensor:
    if target_tokens is None or target_tokens.shape != log_q.shape[:-1]:
        shape = None if target_tokens is None else tuple(target_tokens.shape)
        raise ValueError(f"ce needs target_tokens of shape {tuple(log_q.shape[:-1])}, got {shape}")
    valid = target_tokens >= 0
    ids = target_tokens.clamp(min=0).unsqueeze(-1)
    nll = -log_q.gather(-1, ids).squeeze(-1)
    return torch.where(valid, nll, nll.new_zeros(()))
