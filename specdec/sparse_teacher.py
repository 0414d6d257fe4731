"""The target's distribution as a top-k teacher cache stores it, and the forward KL from it.

A position is the target's k most likely tokens with their log-probabilities and one
log-probability shared by every other token: what a top-k cache keeps (``specdec/data/cache.py``)
and what the losses (``specdec/losses.py``) read without writing out a ``[..., V]`` tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SparseTeacher:
    """The target's distribution over ``width`` tokens kept as a top-k teacher cache stores it:
    its k most likely tokens and one log-probability shared by each of the others. Losses and
    metrics that accept it never build the dense ``[..., width]`` tensor (:meth:`dense` does,
    for the others).

    Args:
        values: ``[..., k]`` log-probabilities of the k tokens (the target's own, not
            renormalised over the ``width``), -inf in unused slots.
        cols: ``[..., k]`` their indices in ``[0, width)``, distinct among used slots (any
            index in unused ones).
        fill: ``[...]`` the log-probability of each token not among them.
        width: the vocabulary's size.
    """

    values: Tensor
    cols: Tensor
    fill: Tensor
    width: int

    def __getitem__(self, index) -> SparseTeacher:
        """The positions ``index`` selects, as a tensor of the leading dimensions would be."""
        return SparseTeacher(self.values[index], self.cols[index], self.fill[index], self.width)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.fill.shape, self.width)

    @property
    def used(self) -> Tensor:
        """``[..., k]`` the slots that hold a token."""
        return self.values > -math.inf

    def __len__(self) -> int:
        return len(self.fill)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device) -> SparseTeacher:
        return SparseTeacher(
            *(x.to(device) for x in (self.values, self.cols, self.fill)), self.width
        )

    def dense(self) -> Tensor:
        """``[..., width]`` the log-probability of every token."""
        values = self.values.float().flatten(0, -2)  # [n, k]
        cols, fill = self.cols.flatten(0, -2), self.fill.float().flatten()
        out = fill[:, None].expand(len(fill), self.width).clone()
        row = torch.arange(len(fill), device=fill.device)[:, None].expand_as(cols)
        used = self.used.flatten(0, -2)
        out[row[used], cols[used]] = values[used]
        return out.view(self.shape)

    def renormalised(self, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """The distribution at ``temperature`` renormalised over the ``width`` tokens:
        ``(log p [..., k], log p of each other token [...], how many others [...])``."""
        others = self.width - self.used.sum(-1)
        values, fill = scaled(self.values.float(), temperature), scaled(self.fill, temperature)
        log_z = _log_total(values, fill, others)
        return values - log_z[..., None], fill - log_z, others

    def log_mass(self) -> Tensor:
        """``[...]`` the log of the probability the target puts on the ``width`` tokens."""
        others = self.width - self.used.sum(-1)
        return _log_total(self.values.float(), self.fill.float(), others)


def _log_total(values: Tensor, fill: Tensor, others: Tensor) -> Tensor:
    """``log(sum exp(values) + others * exp(fill))`` per position."""
    spread = fill + others.float().log()  # -inf when the k fill the vocabulary
    return torch.logsumexp(torch.cat([values, spread[..., None]], dim=-1), dim=-1)


def sparse_forward_kl(
    draft_logits: Tensor, teacher: SparseTeacher, temperature: float = 1.0
) -> Tensor:
    """``KL(p || q)`` per position, ``p`` the :class:`SparseTeacher` renormalised over its
    width and ``q`` the draft's softmax, both at ``temperature``: what :func:`token_losses`
    gives on the dense teacher, with no ``[..., width]`` tensor but the draft's logits.

    With the k kept tokens' ``p_i``, every other's ``p_f`` and the draft's logits z
    (``log q = z - logsumexp(z)``, and the p summing to 1), ``sum_v p_v log q_v`` is
    ``sum_i (p_i - p_f) z_i + p_f sum_v z_v - logsumexp(z)``.

    Args:
        draft_logits: ``[..., width]`` drafter logits.
        teacher: the target's distribution.
        temperature: divides both sides' logits; must be positive.

    Returns:
        ``[...]`` float32 losses.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if draft_logits.shape != teacher.shape:
        raise ValueError(
            f"draft logits {tuple(draft_logits.shape)} and teacher {teacher.shape} differ"
        )
    log_p, log_fill, others = teacher.renormalised(temperature)
    used = teacher.used
    p, p_fill = log_p.exp(), log_fill.exp()
    entropy = torch.where(used, p * log_p, 0.0).sum(-1)
    entropy = entropy + torch.where(others > 0, others * p_fill * log_fill, 0.0)
    coef = torch.where(used, p - p_fill[..., None], 0.0)
    return entropy - _Cross.apply(draft_logits, teacher.cols, coef, p_fill, temperature)


#: rows of logits one pass of :class:`_Cross` works on, on a CPU (a float32 chunk of a few MB,
#: which stays in the caches between the passes over it); on an accelerator one pass takes all
#: rows, since a kernel launch per chunk would cost more than the chunk
CHUNK_ROWS = 128


def _chunks(x: Tensor) -> list[slice]:
    """The row slices of ``x`` that :class:`_Cross` works on, one after the other."""
    size = CHUNK_ROWS if x.device.type == "cpu" else max(len(x), 1)
    return [slice(a, a + size) for a in range(0, len(x), size)]


class _Cross(torch.autograd.Function):
    """``sum_i c_i z_i + p_f sum_v z_v - logsumexp(z)`` per position, ``z`` the logits divided
    by the temperature, and its gradient ``(c scattered at its columns + p_f - softmax(z)) / T``,
    computed a chunk of rows at a time in float32 from logits of any floating dtype.

    Autograd over the same expression keeps several ``[N, width]`` float32 tensors and passes
    over each (the cast, logsumexp's and the sum's backward, their sum, the cast back): on a
    CPU those passes cost more than the LM head's matmuls. Here the forward keeps only the
    logits and the logsumexp, and the backward makes one float32 chunk at a time.
    """

    @staticmethod
    def forward(ctx, logits, cols, coef, p_fill, temperature):
        lead, width = logits.shape[:-1], logits.shape[-1]
        x, c = logits.reshape(-1, width), cols.reshape(-1, cols.shape[-1])
        k, f = coef.reshape(-1, coef.shape[-1]), p_fill.reshape(-1)
        out = torch.empty(len(x), dtype=torch.float32, device=x.device)
        lse = torch.empty_like(out)
        for rows in _chunks(x):
            z = scaled(x[rows].float(), temperature)
            lse[rows] = torch.logsumexp(z, dim=-1)
            kept = (k[rows] * z.gather(-1, c[rows])).sum(-1)
            out[rows] = kept + f[rows] * z.sum(-1) - lse[rows]
        ctx.save_for_backward(x, c, k, f, lse)
        ctx.temperature, ctx.shape = temperature, logits.shape
        return out.view(lead)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, c, k, f, lse = ctx.saved_tensors
        g = grad.reshape(-1).float() / ctx.temperature
        out = torch.empty_like(x)
        for rows in _chunks(x):
            q = x[rows].to(torch.float32, copy=True)  # never a view of float32 logits
            if ctx.temperature != 1.0:
                q.div_(ctx.temperature)
            q.sub_(lse[rows, None]).exp_()
            d = q.neg_().add_(f[rows, None]).scatter_add_(-1, c[rows], k[rows])
            out[rows] = d.mul_(g[rows, None])
        return out.view(ctx.shape), None, None, None, None


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``, without a pass over them at temperature 1."""
    return logits if temperature == 1.0 else logits / temperature
