"""Draft trees for every family that can branch: static trees and dynamic trees.

A static tree (Medusa, Cai et al. 2024) is a fixed set of rank paths: ``(0,)`` and ``(1,)`` are
the draft's two most likely first tokens, ``(0, 0)`` the most likely token after the first of
them. Greedy drafting takes each node's top children; sampling draws them from the draft's
distribution without replacement, each with the exact law it was drawn from, so the verifier's
multi-step rule stays lossless (:mod:`specdec.decoding.tree`).

A dynamic tree (EAGLE-2, Li et al. 2024) follows the draft's own confidence: at each depth the
``top_k`` nodes with the highest path probability (the product of the draft's probabilities
along the path) are expanded into their ``top_k`` most likely children; finally the nodes with
the highest path probability are kept, up to the verify budget. Its nodes are chosen
deterministically from the draft's distributions, so they are verified with one-hot q, which is
exact at every temperature.

The budget: on a CPU the cost of verifying m tokens is far from flat, so the number of nodes
verified is chosen from the measured cost of a target forward over 1 + m tokens, maximising
the expected tokens per second of verification, (1 + sum of the kept nodes' acceptance
estimates) / cost(1 + m). The estimate is the draft's path probability (dynamic trees) or the
acceptance frequency of each rank path measured on warm-up prompts (static trees,
:func:`calibrated_choices`).

Families supply the forward: ``feed(nodes, parents, tokens)`` runs the drafter over new nodes
(each attending to the verified context, its ancestors and itself, at position ``base + depth
- 1``, see :class:`Slots`) and returns their ``[m, D]`` logits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.decoding.sampling import SamplingParams, probabilities
from specdec.decoding.tree import ancestors, depths
from specdec.drafters.base import Proposal
from specdec.drafters.vocabulary import to_target

TREE_KINDS = ("chain", "static", "dynamic")


@dataclass(frozen=True)
class TreeSpec:
    """How a drafter branches.

    Attributes:
        kind: ``static`` or ``dynamic``.
        choices: static: the rank paths, each path's prefixes included.
        top_k: dynamic: children per expanded node and nodes expanded per depth.
        budget: dynamic: nodes verified per round; 0: chosen each round from ``verify_costs``.
        confidence: dynamic: expand a depth's nodes (a draft forward) only while the best of
            them has a path probability (by the draft) of at least this; 0: full depth.
        verify_costs: ``verify_costs[m]``: measured seconds of a target forward over 1 + m
            tokens (a tree of m nodes), m = 0.. .
    """

    kind: str
    choices: tuple[tuple[int, ...], ...] = ()
    top_k: int = 4
    budget: int = 0
    verify_costs: tuple[float, ...] = ()
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("static", "dynamic"):
            raise ValueError(f"tree kind {self.kind!r}: expected static or dynamic")
        if self.kind == "static":
            check_choices(self.choices)
            object.__setattr__(self, "choices", tuple(sorted(map(tuple, self.choices), key=_order)))
        elif self.top_k < 1:
            raise ValueError(f"tree top_k: must be >= 1, got {self.top_k}")
        elif self.budget < 1 and len(self.verify_costs) < 2:
            raise ValueError("a dynamic tree needs a budget or measured verify costs")

    def describe(self) -> dict:
        """What a score records of the tree."""
        if self.kind == "static":
            return {"kind": "static", "choices": [list(c) for c in self.choices]}
        budget = self.budget or "cost-chosen"
        return {
            "kind": "dynamic",
            "top_k": self.top_k,
            "budget": budget,
            "confidence": self.confidence,
        }


def check_choices(choices: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless ``choices`` is a non-empty set of rank paths closed under
    prefixes (the tree's every node has its parent)."""
    paths = {tuple(c) for c in choices}
    if not paths or () in paths:
        raise ValueError("tree choices: expected non-empty rank paths, e.g. [[0], [1], [0, 0]]")
    for path in sorted(paths, key=_order):
        if any(not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(f"tree choices: {list(path)}: ranks must be integers >= 0")
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"tree choices: {list(path)} without its parent {list(path[:-1])}")


def _order(path: tuple[int, ...]) -> tuple:
    return (len(path), path)


class Slots:
    """Where a drafter's fed tree nodes sit in its cache, after ``base`` verified entries."""

    def __init__(self, base: int):
        self.base, self.end, self.slot = base, base, {}

    def feed(self, nodes: list[int], parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Place ``nodes`` next in the cache; return their ``[m]`` positions and their mask
        over the tree's entries, ``[m, end - base]`` (the verified entries before are visible:
        a node sees them, its fed ancestors and itself)."""
        start, m = self.end, len(nodes)
        for r, j in enumerate(nodes):
            self.slot[j] = start + r
        self.end += m
        mask = torch.zeros(m, self.end - self.base, dtype=torch.bool)
        for r, j in enumerate(nodes):
            mask[r, [self.slot[a] - self.base for a in ancestors(parents, j)]] = True
        depth = depths(parents)
        positions = torch.tensor([self.base + depth[j] - 1 for j in nodes])
        return positions, mask


Feed = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


def draft_tree(
    spec: TreeSpec,
    logits: torch.Tensor,
    feed: Feed,
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_ids: torch.Tensor | None,
    vocab_size: int,
) -> Proposal:
    """A tree of depth at most ``k`` after the sequence.

    Args:
        spec: the tree's shape.
        logits: ``[D]`` the drafter's logits for the first token.
        feed: the family's forward over new nodes (see the module docstring); ``tokens`` are
            target ids.
        k: the most tokens the round may add, so the tree's depth.
        params: greedy or sampling (static trees then sample their nodes).
        generator: randomness for sampled nodes.
        draft_ids: ``[D]`` target ids of the drafter's outputs (None: the target's vocabulary).
        vocab_size: the target's vocabulary size.
    """

    def to_ids(draft: list[int]) -> torch.Tensor:
        t = torch.tensor(draft, dtype=torch.long, device=logits.device)
        return t if draft_ids is None else draft_ids[t]

    def feed_draft(nodes: list[int], parents: list[int], draft: list[int]) -> torch.Tensor:
        return feed(nodes, parents, to_ids(draft))

    build = _static if spec.kind == "static" else _dynamic
    draft, parents, q = build(spec, logits, feed_draft, k, params, generator)
    probs = to_target(torch.stack(q), draft_ids, vocab_size) if q else None
    return Proposal(to_ids(draft), probs, torch.tensor(parents, dtype=torch.long))


def _static(spec, logits, feed, k, params, generator):
    """Nodes of the rank paths no deeper than k; one feed per depth for the nodes with
    children."""
    choices = [c for c in spec.choices if len(c) <= k]
    node = {(): -1}
    draft, parents, q = [], [], []
    rows = logits[None]  # [f, D] the logits of the nodes expanded at this depth
    for depth in range(1, max(map(len, choices)) + 1):
        level = [c for c in choices if len(c) == depth]
        expand = list(dict.fromkeys(c[:-1] for c in level if c[:-1] in node))
        if not expand:  # their parents were not drawn (a sampled q with a small support)
            break
        if depth > 1:
            fed = [node[p] for p in expand]
            rows = feed(fed, parents, [draft[j] for j in fed])
        ranks = [{c[-1] for c in level if c[:-1] == prefix} for prefix in expand]
        drawn, laws = _children(rows, max(map(max, ranks)) + 1, params, generator)
        for r, prefix in enumerate(expand):
            for rank in sorted(ranks[r]):
                if rank < len(drawn[r]):
                    node[prefix + (rank,)] = len(draft)
                    draft.append(drawn[r][rank])
                    parents.append(node[prefix])
                    if laws is not None:
                        q.append(laws[r, rank])
    return draft, parents, q


def _children(logits: torch.Tensor, n: int, params: SamplingParams, generator):
    """Up to ``n`` distinct children of each of ``f`` nodes from their ``[f, D]`` logits: the
    top n (greedy), or n draws without replacement from the draft's q, each with the law it
    was drawn from (q without the earlier draws, renormalised). The draws use the Gumbel-top-k
    trick (Kool et al. 2019): the n largest of log q + Gumbel noise are distributed as n
    sequential draws without replacement.

    Returns:
        ``(tokens, laws)``: per node, its children's draft ids; ``[f, n, D]`` their laws, or
        None when greedy.
    """
    n = min(n, logits.shape[-1])
    if params.greedy:
        return logits.float().topk(n, dim=-1).indices.tolist(), None
    q = probabilities(logits, params)  # [f, D]
    u = torch.rand(q.shape, device=q.device, generator=generator).clamp_min(1e-20)
    drawn = (q.log() - (-u.log()).log()).topk(n, dim=-1).indices  # [f, n]
    taken = torch.zeros(q.shape[0], n, q.shape[-1], device=q.device)
    taken[:, 1:] = torch.nn.functional.one_hot(drawn[:, :-1], q.shape[-1]).cumsum(1)
    laws = q[:, None] * (1 - taken)  # [f, n, D]
    mass = laws.sum(-1, keepdim=True)
    # a node with fewer than n tokens of positive q has fewer children
    support = (q > 0).sum(-1).tolist()
    tokens = [row[:m] for row, m in zip(drawn.tolist(), support, strict=True)]
    return tokens, laws / mass.clamp_min(1e-30)


def _dynamic(spec, logits, feed, k, params, generator):
    """EAGLE-2: expand the top_k most probable nodes of each depth, keep the best nodes."""
    draft, parents, score = [], [], []  # score: log of the draft's path probability
    frontier, rows = [-1], logits[None]
    for depth in range(1, k + 1):
        if depth > 1:
            rows = feed(frontier, parents, [draft[j] for j in frontier])
        log_q = _log_probs(rows, params)  # [f, D]
        top = log_q.topk(min(spec.top_k, log_q.shape[-1]), dim=-1)
        values, tokens = top.values.tolist(), top.indices.tolist()
        new = []
        for r, u in enumerate(frontier):
            for value, token in zip(values[r], tokens[r], strict=True):
                if value == float("-inf"):
                    break
                new.append(len(draft))
                draft.append(token)
                parents.append(u)
                score.append((score[u] if u >= 0 else 0.0) + min(value, 0.0))
        frontier = sorted(new, key=lambda j: -score[j])[: spec.top_k]
        # expanding costs a draft forward: not when even the best node is unlikely (this
        # depends on the draft's distributions only, so decoding stays exact)
        if not frontier or math.exp(score[frontier[0]]) < spec.confidence:
            break
    depth = depths(parents)
    # a child's score never exceeds its parent's: the best m are closed under parents
    best = sorted(range(len(draft)), key=lambda j: (-score[j], depth[j]))
    m = spec.budget or choose_budget([math.exp(score[j]) for j in best], spec.verify_costs)
    kept = sorted(best[:m], key=lambda j: (depth[j], j))  # parents first, siblings by rank
    index = {j: i for i, j in enumerate(kept)}
    return [draft[j] for j in kept], [index.get(parents[j], -1) for j in kept], []


def _log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probabilities(logits, params).log()


def choose_budget(estimates: Sequence[float], verify_costs: Sequence[float]) -> int:
    """The number of nodes m maximising (1 + sum(estimates[:m])) / verify_costs[m].

    Args:
        estimates: acceptance estimates of the candidate nodes, best first.
        verify_costs: ``verify_costs[m]``: seconds to verify a tree of m nodes.
    """
    limit = min(len(estimates), len(verify_costs) - 1)
    best_m, best_rate, expected = 1, 0.0, 1.0
    for m in range(1, limit + 1):
        expected += estimates[m - 1]
        rate = expected / verify_costs[m]
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m


def calibrated_choices(
    paths: Sequence[Sequence[int]], rounds: int, verify_costs: Sequence[float]
) -> tuple[tuple[int, ...], ...]:
    """A static tree from accepted paths: each rank path's acceptance frequency (the share of
    ``rounds`` whose accepted path starts with it), the most frequent kept up to the budget
    :func:`choose_budget` picks (a prefix is at least as frequent as its extensions, so the
    tree is closed under parents)."""
    counts = Counter(tuple(p[:i]) for p in paths for i in range(1, len(p) + 1))
    if not counts:
        return ((0,),)
    ranked = sorted(counts, key=lambda c: (-counts[c], _order(c)))
    m = choose_budget([counts[c] / rounds for c in ranked], verify_costs)
    return tuple(sorted(ranked[:m], key=_order))
