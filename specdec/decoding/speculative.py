"""Chain speculative decoding for one sequence, and plain decoding through the same loop.

Each round (Leviathan et al. 2023; Chen et al. 2023): the drafter proposes up to k tokens after
the sequence; the target runs once over [last token, draft...] on top of its KV cache; the
verifier keeps the accepted prefix and adds one token of the target's own; both caches are
rolled back to what was kept. Without a drafter the same loop is plain autoregressive decoding,
so the baseline and the method share every line of code outside the draft.

A drafter may propose a tree instead (:mod:`specdec.decoding.tree`): the target then reads
the root and every node in the same one forward under a tree mask, the verifier walks the
accepted path, and the caches keep that path only.

Invariant: the target's cache holds every token of the sequence except the last one, which is
fed at the start of the next round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.decoding import tree
from specdec.decoding.sampling import SamplingParams, choose, probabilities
from specdec.decoding.session import Kept, ModelSession
from specdec.decoding.verify import verify_greedy, verify_sampling
from specdec.drafters.base import Drafter


@dataclass
class Generation:
    """One decoded sequence and how it was decoded.

    Attributes:
        tokens: the new tokens (EOS included when reached), at most max_new_tokens.
        drafted: per round, the number of draft tokens verified (a tree's node count).
        depths: per round, the draft's depth (a chain's length, a tree's deepest path).
        accepted: per round, the number of draft tokens accepted.
        paths: per tree round, the accepted path as sibling ranks (``(0, 1)``: the first child
            of the root, then that node's second child); chain rounds add nothing.
        overlaps: per sampled chain round, for each drafted position i, sum_x min(p_i, q_i)
            (p the target's, q the draft's distribution; one-hot q for a deterministic draft):
            the probability that position i is accepted given the positions before it were.
            Greedy and tree rounds add nothing.
        draft_seconds / verify_seconds / round_seconds: per-round times (round = draft +
            verify forward + acceptance and bookkeeping).
        keep_seconds: per round, the time spent compacting the target's cache to the kept
            tokens (a tree's accepted path, a chain's prefix).
        prefill_seconds: the prompt's forward and the first token.
        target_forward_seconds / draft_forward_seconds: time inside model forwards.
        finished: the sequence ended with EOS.
    """

    tokens: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    paths: list[tuple[int, ...]] = field(default_factory=list)
    overlaps: list[list[float]] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    keep_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    target_forward_seconds: float = 0.0
    draft_forward_seconds: float = 0.0
    finished: bool = False

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + sum(self.round_seconds)

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by rounds (the first token comes from the prefill)."""
        return max(len(self.tokens) - 1, 0)


def generate(
    target: ModelSession,
    prompt: Sequence[int],
    *,
    drafter: Drafter | None = None,
    k: int = 4,
    max_new_tokens: int = 128,
    params: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verify_lengths: Sequence[int] | None = None,
) -> Generation:
    """Decode one continuation of ``prompt`` with speculative decoding (plain without drafter).

    Args:
        target: the target's session; it is reset here.
        prompt: prompt token ids.
        drafter: proposes draft tokens; None decodes autoregressively.
        k: draft tokens per round (fewer near max_new_tokens).
        max_new_tokens: upper bound on new tokens, EOS included.
        params: greedy when temperature is 0, else lossless speculative sampling.
        eos_token_ids: tokens that end the sequence (emitted, then decoding stops).
        generator: randomness for sampling and the acceptance test.
        verify_lengths: ``verify_lengths[n]`` is how many tokens to verify when n were drafted
            (from a measured cost profile, see :func:`cheapest_verify_lengths`); the draft is
            padded with deterministic guesses up to it. None verifies exactly n + 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out = Generation()
    eos = set(eos_token_ids)
    clock = target.clock
    target.reset()
    target_start = target.forward_seconds
    draft_start = drafter.draft_seconds if drafter else 0.0

    t0 = clock()
    logits = target.extend(list(prompt), last_only=True)
    out.tokens.append(int(choose(logits[-1], params, generator)))
    if drafter is not None:
        drafter.begin(prompt, target.hidden or None)
    out.prefill_seconds = clock() - t0

    sequence = list(prompt) + out.tokens
    while out.tokens[-1] not in eos and len(out.tokens) < max_new_tokens:
        t0 = clock()
        budget = min(k, max_new_tokens - len(out.tokens) - 1)
        proposal = None
        if drafter is not None and budget > 0:
            proposal = drafter.propose(sequence, budget, params, generator)
        if proposal is not None and proposal.parents is not None:
            t1 = clock()
            n, new, kept, rows, ranks, depth = _verify_tree(
                target, sequence, proposal, params, generator
            )
            own = len(proposal)
            out.paths.append(ranks)
        else:
            draft, q = _chain(proposal, target.device)
            own = depth = len(draft)
            if verify_lengths is not None and own and budget > own:
                draft, q = _pad(draft, q, min(verify_lengths[own], budget + 1) - 1 - own)
            t1 = clock()
            last = torch.tensor(sequence[-1:], device=draft.device)
            logits = target.extend(torch.cat([last, draft]))
            if params.greedy:
                n, new = verify_greedy(draft, logits)
            else:
                p = probabilities(logits, params)
                n, new = verify_sampling(draft, q, p, generator)
                if own:
                    out.overlaps.append(
                        overlap(p[:own], q[:own] if q is not None else None, draft[:own])
                    )
            kept, rows = range(len(sequence) + n), slice(0, n + 1)
        t2 = clock()
        target.keep(kept)
        out.keep_seconds.append(clock() - t2)
        if drafter is not None:
            drafter.commit(n, {i: h[rows] for i, h in target.hidden.items()} or None)
        new = _stop_at_eos(new, eos)[: max_new_tokens - len(out.tokens)]
        out.tokens += new
        sequence += new
        out.drafted.append(own)  # padding counts in tau when accepted, not in acceptance rates
        out.depths.append(depth)
        out.accepted.append(min(n, own))
        out.draft_seconds.append(t1 - t0)
        out.verify_seconds.append(t2 - t1)
        out.round_seconds.append(clock() - t0)

    out.finished = out.tokens[-1] in eos
    out.target_forward_seconds = target.forward_seconds - target_start
    out.draft_forward_seconds = (drafter.draft_seconds - draft_start) if drafter else 0.0
    return out


def overlap(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> list[float]:
    """``sum_x min(p_i(x), q_i(x))`` for each of the ``[n, V]`` rows: position i's chance of
    acceptance given the context before it (Leviathan et al. 2023, sec. 3.1: beta). A
    deterministic draft (q None) is one-hot at its token, so the overlap is p_i(token)."""
    if q is None:
        return p[torch.arange(len(draft), device=p.device), draft].tolist()
    return torch.minimum(p, q.to(p.dtype)).sum(dim=-1).tolist()


def _chain(proposal, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    if proposal is None:
        return torch.empty(0, dtype=torch.long, device=device), None
    return proposal.tokens.to(device), proposal.probs


def _verify_tree(target: ModelSession, sequence: list[int], proposal, params, generator):
    """One target forward over ``[last token, nodes]`` under the tree mask, then the walk.

    Returns:
        ``(n, emitted, kept, rows, ranks, depth)``: accepted nodes, emitted tokens, the cache
        indices to keep (the sequence and the accepted path), the forward's rows of the kept
        positions (for the drafter's features), the path as sibling ranks and the tree's depth.
    """
    parents = [int(j) for j in proposal.parents.tolist()]
    cached = len(sequence) - 1
    depths = tree.depths(parents)
    positions = torch.tensor([cached] + [cached + d for d in depths])
    tokens = torch.cat([torch.tensor(sequence[-1:]), proposal.tokens.cpu()]).to(target.device)
    logits = target.extend(tokens, positions=positions, mask=tree.tree_mask(parents))
    if params.greedy:
        path, emitted = tree.verify_tree_greedy(proposal.tokens, parents, logits)
    else:
        p = probabilities(logits, params)
        path, emitted = tree.verify_tree_sampling(
            proposal.tokens, proposal.probs, parents, p, generator
        )
    kids = tree.children(parents)
    ranks = tuple(kids[1 + parents[j]].index(j) for j in path)
    rows = [0] + [1 + j for j in path]
    kept = Kept(cached, [cached + r for r in rows])
    return len(path), emitted, kept, rows, ranks, max(depths, default=0)


def cheapest_verify_lengths(profile: dict[int, float], k: int) -> list[int]:
    """For each draft length n in 0..k, the verify length m in [n + 1, k + 1] with the lowest
    measured cost. On a CPU a 5-token forward can cost less than a 3-token one (GEMM shapes),
    so verifying a padded draft is then both cheaper and a chance at more tokens."""
    return [min(range(n + 1, k + 2), key=lambda m: (profile[m], m)) for n in range(k + 1)]


def _pad(draft: torch.Tensor, q: torch.Tensor | None, extra: int):
    """Extend a draft by repeating its last token (a deterministic guess: one-hot q)."""
    if extra <= 0:
        return draft, q
    filler = draft[-1:].expand(extra)
    if q is not None:
        q = torch.cat([q, torch.nn.functional.one_hot(filler, q.shape[-1]).to(q.dtype)])
    return torch.cat([draft, filler]), q


def _stop_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
