"""Draft trees: many candidate continuations verified exactly in one target forward.

A tree proposal has nodes 0..n-1: node j holds a token and the index of its parent (-1: the
root, the last token of the sequence, not yet in the target's cache). Parents come before
their children, and siblings in the order they were drawn. The target reads ``[root, nodes]``
in one forward, node j at position ``base + depth(j)``, each row attending to the cache, its
ancestors and itself (:func:`tree_mask`); logits row 0 predicts the token after the root, row
``1 + j`` the token after node j.

Greedy: from the root, descend to the child whose token is the target's argmax; where no
child is, emit that argmax. Every emitted token is the target's argmax after the tokens
before it, so the output is plain greedy decoding's.

Sampling (SpecInfer, Miao et al. 2024, multi-step speculative sampling): at a node with the
target's distribution p, its children x_1, x_2, ... are tried in turn, x_i drawn from q_i (its
law given the siblings drawn before it). x_i is accepted with probability min(1, p(x)/q_i(x));
on a rejection p becomes norm(max(0, p - q_i)) and the next sibling is tried; after the last
rejection a token is drawn from the current p and the round ends; after an acceptance the walk
descends; a node without children emits a draw from its p (the bonus token).

Why it is exact: one step with target p and draft q_i leaves a token distributed as p, since
P(x) = min(p(x), q_i(x)) + (1 - sum min(p, q_i)) norm(max(0, p - q_i))(x) = p(x) (the rejection
mass 1 - sum min(p, q_i) equals sum max(0, p - q_i)). Trying the next sibling instead of drawing
from the residual is another such step whose target is that residual, so by induction over the
siblings the token leaving a node is distributed as p; whether the walk descends depends on
that token only, so the walk is the target's own autoregressive sampling. The induction needs
x_i ~ q_i given everything drawn before it and no dependence on the verifier's randomness:
siblings drawn i.i.d. (q_i = q), without replacement (q_i = q renormalised without the earlier
draws), or chosen deterministically, e.g. a top-k tree (q_i one-hot: x_i is accepted with
probability p(x_i), the residual is p without x_i; the walk then samples p and follows the
matching child).
"""

from __future__ import annotations

import torch

from specdec.decoding import verify
from specdec.decoding.sampling import sample


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the root has depth 1)."""
    out: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"tree node {j}: parent {parent} must be -1 or an earlier node")
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestors(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (its path, itself included)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_mask(parents: list[int], device=None) -> torch.Tensor:
    """``[n + 1, n + 1]`` booleans over ``[root, nodes]``: True where a row may attend (the
    root, its ancestors and itself); the cache before the root is visible to every row."""
    n = len(parents)
    rows = [[True] + [False] * n]
    for j, parent in enumerate(parents):
        row = list(rows[1 + parent])  # the parent's row (the root's for -1), plus itself
        row[1 + j] = True
        rows.append(row)
    return torch.tensor(rows, device=device)


def children(parents: list[int]) -> list[list[int]]:
    """``children[1 + u]``: the nodes whose parent is u, in order (``children[0]``: the
    root's)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, parent in enumerate(parents):
        out[1 + parent].append(j)
    return out


def verify_tree_greedy(
    tokens: torch.Tensor, parents: list[int], logits: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Greedy tree verification.

    Args:
        tokens: ``[n]`` the nodes' token ids.
        parents: each node's parent (-1: the root).
        logits: ``[n + 1, V]``; row 0 after the root, row ``1 + j`` after node j.

    Returns:
        ``(path, emitted)``: the accepted nodes from the root down, and the ``len(path) + 1``
        emitted tokens (the path's tokens, then the target's own).
    """
    best = logits.argmax(dim=-1).tolist()  # one host transfer for the whole tree
    ids = tokens.tolist()
    kids = children(parents)
    path, row = [], 0
    while True:
        match = next((c for c in kids[row] if ids[c] == best[row]), None)
        if match is None:
            return path, [ids[j] for j in path] + [best[row]]
        path.append(match)
        row = 1 + match


def verify_tree_sampling(
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    parents: list[int],
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[int]]:
    """Lossless tree verification (multi-step speculative sampling, see the module docstring).

    Args:
        tokens: ``[n]`` the nodes' token ids.
        q: ``[n, V]`` the law each node was drawn from given its earlier siblings, or None when
            every node was chosen deterministically (one-hot q).
        parents: each node's parent (-1: the root).
        p: ``[n + 1, V]`` the target's processed distributions; row 0 after the root.
        generator: randomness for the acceptance tests and the draws.

    Returns:
        ``(path, emitted)`` as :func:`verify_tree_greedy`.
    """
    ids = tokens.tolist()
    kids = children(parents)
    path, row = [], 0
    while True:
        residual = p[row]
        for child in kids[row]:
            x = ids[child]
            q_x = float(q[child, x]) if q is not None else 1.0
            u = float(torch.rand(1, device=p.device, generator=generator))
            if u * q_x < float(residual[x]):
                path.append(child)
                row = 1 + child
                break
            residual = verify.residual(residual, q[child] if q is not None else None, x)
        else:
            return path, [ids[j] for j in path] + [int(sample(residual, generator))]
