"""Tree speculative sampling emits exactly the target's distribution: the chi-square test of
``test_sampling_exactness`` (Markov target and drafters, transitions pooled over the previous
token) on trees of several shapes, with sampled siblings (drawn without replacement, or
i.i.d. with repeats) and deterministic top-k trees (one-hot q), under temperature, top-k and
top-p; and the same test catching a verifier that forgets to update the residual after a
sibling's rejection."""

from __future__ import annotations

import pytest
import torch
from markov import MarkovDrafter
from test_sampling_exactness import (
    DETECT_LEVEL,
    L_Q,
    PASS_LEVEL,
    TOKENS,
    decode,
    transition_test,
)

from specdec.decoding import verify
from specdec.decoding.sampling import SamplingParams, probabilities, sample
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.tree import TreeSpec, draft_tree


class MarkovTree(Drafter):
    """Trees drafted by the library's tree builders over a Markov table: a node's logits are
    the table's row of its token."""

    name = "markov_tree"
    branches = True

    def __init__(self, table: torch.Tensor, spec: TreeSpec):
        self.table, self.tree = table, spec

    def propose(self, sequence, k, params, generator=None) -> Proposal:
        def feed(nodes, parents, tokens):
            return self.table[tokens]

        logits = self.table[sequence[-1]]
        return draft_tree(self.tree, logits, feed, k, params, generator, None, len(self.table))


class IidSiblings(MarkovDrafter):
    """Each node gets ``width`` children drawn i.i.d. from q (repeats possible), ``depth``
    levels deep, every child of the first child expanded: q_i = q for every sibling."""

    branches = True

    def __init__(self, table, width: int = 3):
        super().__init__(table)
        self.width = width

    def propose(self, sequence, k, params, generator=None) -> Proposal:
        rows = self.rows(params)
        tokens, parents, q = [], [], []
        parent, last = -1, sequence[-1]
        for _ in range(k):
            drawn = sample(rows[last].expand(self.width, -1), generator).tolist()
            first = len(tokens)
            tokens += drawn
            parents += [parent] * self.width
            q += [rows[last]] * self.width
            parent, last = first, drawn[0]
        return Proposal(torch.tensor(tokens), torch.stack(q), torch.tensor(parents))


WIDE = ((0,), (1,), (2,), (3,), (4,), (0, 0), (1, 0))
# deep, with ranks skipped: (1,) and (0, 1) are drawn but not verified, (2,) and (0, 2) are
DEEP = ((0,), (2,), (0, 0), (0, 2), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0), (2, 0), (2, 0, 0))
COSTS = (1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.2, 2.4, 2.6, 3.0)
PLAIN = SamplingParams(temperature=1.0)
CONFIGS = {
    "static_wide": (lambda: MarkovTree(L_Q, TreeSpec("static", WIDE)), PLAIN, 2),
    "static_deep_warped": (
        lambda: MarkovTree(L_Q, TreeSpec("static", DEEP)),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        4,
    ),
    "dynamic_one_hot": (
        lambda: MarkovTree(L_Q, TreeSpec("dynamic", top_k=3, verify_costs=COSTS)),
        SamplingParams(temperature=0.7, top_p=0.8),
        4,
    ),
    "iid_siblings": (lambda: IidSiblings(L_Q), SamplingParams(temperature=1.0, top_k=6), 3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_sampling_follows_the_target(name):
    make, params, k = CONFIGS[name]
    out, sequence = decode(make(), params, k)
    result = transition_test(sequence, params)
    assert result["outside"] == 0, f"{name}: tokens emitted where p = 0: {result}"
    assert result["pvalue"] > PASS_LEVEL, f"{name}: emitted law differs from p: {result}"
    assert len(out.paths) > TOKENS / (k + 1)  # tree rounds, not a chain
    assert sum(out.accepted) > 0.2 * TOKENS  # paths through the trees were accepted


def test_residual_not_updated_after_a_sibling_is_caught(monkeypatch):
    """A planted bug: after a sibling's rejection the next one is tested against p itself
    instead of the residual. The same test must reject the emitted law."""
    monkeypatch.setattr(verify, "residual", lambda p, q, drafted: p)
    make, params, k = CONFIGS["static_wide"]
    _, sequence = decode(make(), params, k)
    assert transition_test(sequence, params)["pvalue"] < DETECT_LEVEL


def test_one_sibling_walk_matches_the_chain_rule():
    """A node with siblings x1, x2 (one-hot q): P(emit x1) = p(x1), P(emit x2) = p(x2), and
    any other token comes from p without them, so the first token is distributed as p."""
    p = probabilities(torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 3), PLAIN)
    from specdec.decoding.tree import verify_tree_sampling

    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    trials = 40_000
    for _ in range(trials):
        _, emitted = verify_tree_sampling(torch.tensor([1, 0]), None, [-1, -1], p, generator)
        counts[emitted[0]] += 1
    expected = p[0] * trials
    statistic = float(((counts - expected) ** 2 / expected).sum())
    from scipy.stats import chi2

    assert chi2.sf(statistic, df=3) > PASS_LEVEL
