"""First-order Markov test doubles for the decoder: a target session and drafters whose
next-token logits depend only on the last token, read from a fixed ``[V, V]`` table.

With such a target the exact distribution of every emitted token is known in closed form,
``probabilities(table[previous], params)``, so the speculative sampling loop can be checked
against it by counting transitions over one long decoded sequence. The doubles offer the same
duck-typed interface as :class:`specdec.decoding.session.ModelSession` and
:class:`specdec.drafters.base.Drafter`; nothing here models a KV cache beyond the token list.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import numpy as np
import torch

from specdec.decoding.sampling import SamplingParams, probabilities
from specdec.decoding.session import moved_tail
from specdec.drafters.base import Drafter, Proposal

NEG_INF = float("-inf")


def random_table(vocab: int, seed: int, zero_fraction: float = 0.25) -> torch.Tensor:
    """A seeded ``[V, V]`` logit table mixing peaked, medium and flat rows.

    A ``zero_fraction`` of each row's entries is set to -inf (probability zero at every
    temperature); every row keeps at least two finite entries.
    """
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([4.0, 1.5, 0.3])[torch.arange(vocab) % 3]  # peaked / medium / flat
    table = torch.randn(vocab, vocab, generator=g) * scale[:, None]
    order = torch.rand(vocab, vocab, generator=g).argsort(dim=-1)
    n_zero = min(int(zero_fraction * vocab), vocab - 2)
    dropped = torch.zeros(vocab, vocab, dtype=torch.bool).scatter(-1, order[:, :n_zero], True)
    return table.masked_fill(dropped, NEG_INF)


def nearby_table(target: torch.Tensor, seed: int, noise: float = 0.3) -> torch.Tensor:
    """A drafter table close to ``target``: its logits plus Gaussian noise, with a different
    set of -inf entries (so q > 0 where p = 0 and q = 0 where p > 0 both occur)."""
    fresh = random_table(target.shape[0], seed)
    g = torch.Generator().manual_seed(seed + 1)
    table = torch.where(torch.isfinite(target), target, target.new_full((), -2.0))
    table = table + noise * torch.randn(target.shape, generator=g)
    return table.masked_fill(~torch.isfinite(fresh), NEG_INF)


def disjoint_table(target: torch.Tensor, seed: int) -> torch.Tensor:
    """A drafter table whose support is the complement of the target's in even rows (no token
    in common, so every draft from there is rejected) and overlaps it in odd rows."""
    table = nearby_table(target, seed)
    complement = torch.randn(target.shape, generator=torch.Generator().manual_seed(seed + 1))
    complement = complement.masked_fill(torch.isfinite(target), NEG_INF)
    even = (torch.arange(target.shape[0]) % 2 == 0)[:, None]
    return torch.where(even, complement, table)


def reference_law(table: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """``[V, V]`` the law sampled from after temperature, top-k and top-p, written in numpy
    independently of :func:`specdec.decoding.sampling.probabilities` (the expected values of
    the statistical tests must not come from the code under test).

    Top-k keeps the tokens whose logit reaches the k-th largest; top-p keeps, in descending
    order, each token while the mass before it is still under top_p."""
    logits = table.double().numpy() / params.temperature
    out = np.zeros_like(logits)
    for s, row in enumerate(logits):
        keep = np.isfinite(row)
        if 0 < params.top_k < len(row):
            kth = np.sort(row)[::-1][params.top_k - 1]
            keep &= row >= kth
        weights = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        law = weights / weights.sum()
        if params.top_p < 1.0:
            order = np.argsort(-law, kind="stable")
            before = np.concatenate([[0.0], np.cumsum(law[order])[:-1]])
            law[order[before >= params.top_p]] = 0.0
            law /= law.sum()
        out[s] = law
    return out


class MarkovTarget:
    """A target session whose logits after token s are ``table[s]`` whatever came before.

    Args:
        table: ``[V, V]`` logits, row s predicting the token after s.
    """

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.device = torch.device("cpu")
        self.clock = time.perf_counter
        self.forward_seconds = 0.0
        self.hidden: dict[int, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def extend(
        self,
        tokens: Sequence[int] | torch.Tensor,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[m, V]`` (``[1, V]`` with ``last_only``), row j = ``table[tokens[j]]``
        whatever the positions and the mask (a tree node's logits depend on its token only)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        self.ids += tokens.tolist()
        logits = self.table[tokens]
        return logits[-1:] if last_only else logits

    def rollback(self, length: int) -> None:
        del self.ids[length:]

    def keep(self, indices: Sequence[int]) -> None:
        start, tail = moved_tail(indices)
        self.ids[start : start + len(tail)] = [self.ids[i] for i in tail]
        self.rollback(len(indices))


class MarkovDrafter(Drafter):
    """Drafts k tokens by sampling its own table after the same temperature/top-k/top-p as the
    target, and reports the exact rows it sampled from.

    Args:
        table: ``[V, V]`` drafter logits.
    """

    name = "markov"

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._warped: dict[SamplingParams, tuple[torch.Tensor, list, list]] = {}

    def rows(self, params: SamplingParams) -> torch.Tensor:
        """``[V, V]`` the processed drafter distributions (computed once per params)."""
        return self._sampler(params)[0]

    def _sampler(self, params: SamplingParams) -> tuple[torch.Tensor, list, list]:
        """The processed rows, their float64 CDFs and each row's last token with q > 0."""
        if params not in self._warped:
            rows = probabilities(self.table, params)
            cdf = rows.double().cumsum(dim=-1).tolist()
            last = [max(i for i, x in enumerate(row) if x > 0) for row in rows.tolist()]
            self._warped[params] = rows, cdf, last
        return self._warped[params]

    def reported(self, params: SamplingParams) -> torch.Tensor:
        """``[V, V]`` the distributions announced to the verifier: the sampled ones."""
        return self.rows(params)

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        _, cdf, last_positive = self._sampler(params)
        tokens = []
        last = sequence[-1]
        # inverse-CDF draws: one call for k uniforms instead of k multinomial calls; a token
        # with q = 0 adds an empty interval to the CDF, so it is never drawn
        for u in torch.rand(k, dtype=torch.float64, generator=generator).tolist():
            row = cdf[last]
            last = bisect.bisect_right(row, u * row[-1], hi=last_positive[last])
            tokens.append(last)
        drawn = torch.tensor(tokens, dtype=torch.long)
        previous = torch.cat([torch.tensor(sequence[-1:]), drawn[:-1]])
        return Proposal(drawn, self.reported(params)[previous])


class MislabelledDrafter(MarkovDrafter):
    """A broken drafter: samples after top-k/top-p like :class:`MarkovDrafter` but reports the
    distribution before them (temperature only), the bug of a verifier fed un-warped q."""

    name = "markov_mislabelled"

    def reported(self, params: SamplingParams) -> torch.Tensor:
        return probabilities(self.table, SamplingParams(temperature=params.temperature))


class GreedyMarkovDrafter(Drafter):
    """A deterministic drafter (one-hot q): follows the argmax chain of its table, and stops
    early before any token in ``stop`` (so some proposals are short or empty).

    Args:
        table: ``[V, V]`` drafter logits.
        stop: tokens never proposed.
    """

    name = "markov_greedy"

    def __init__(self, table: torch.Tensor, stop: Sequence[int] = ()):
        self.next_token = table.argmax(dim=-1).tolist()
        self.stop = set(stop)

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        tokens = []
        last = sequence[-1]
        while len(tokens) < k and self.next_token[last] not in self.stop:
            last = self.next_token[last]
            tokens.append(last)
        return Proposal(torch.tensor(tokens, dtype=torch.long))
