"""What a scoring run measured, reduced to the numbers that say what a drafter is worth.

tau: tokens emitted per target forward in the decoding rounds, bonus token included (plain
decoding has tau = 1). Acceptance per draft position i: P(accepted length >= i) over the rounds
that drafted position i, and conditional P(position i accepted | positions < i accepted). Cost
ratios (Leviathan et al. 2023, sec. 3): c = one draft step / one target step, v = one verify
forward (mean over rounds) / one target step. The analytic speedup for a per-token acceptance
rate alpha is (1 - alpha^(k+1)) / ((1 - alpha) (k c + v)), with k the mean draft length where
drafts are shorter than k (prompt lookup without a match, a draft model's confidence stop); the
decoder's efficiency is the measured speedup over that bound. The bound assumes every draft
token is accepted with the same alpha: a confidence stop drafts the likelier tokens, so its
efficiency can exceed 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.decoding.speculative import Generation


def acceptance(gens: Sequence[Generation], k: int) -> dict:
    """Per-position acceptance and the accepted-length histogram over all rounds.

    Returns:
        ``{"tau", "alpha", "accept_rate_per_position", "conditional_accept_rate_per_position",
        "accepted_length_histogram", "rounds", "mean_drafted", "mean_depth"}``; position lists
        have k entries, None at a position no round drafted (a rate of nothing, not 0). A
        tree's positions are depths: accept@i is the share of rounds whose accepted path
        reaches depth i, among those whose tree does.
    """
    drafted = [d for g in gens for d in g.drafted]
    # the draft's depth: a chain's length, a tree's deepest path (positions are depths)
    depths = [d for g in gens for d in g.depths]
    accepted = [a for g in gens for a in g.accepted]
    rounds = len(drafted)
    emitted = sum(g.decode_tokens for g in gens)
    reached = [
        sum(1 for d, a in zip(depths, accepted, strict=True) if d >= i and a >= i - 1)
        for i in range(1, k + 1)
    ]
    passed = [sum(1 for a in accepted if a >= i) for i in range(1, k + 1)]
    offered = [sum(1 for d in depths if d >= i) for i in range(1, k + 1)]
    rejections = sum(1 for d, a in zip(depths, accepted, strict=True) if a < d)
    return {
        "tau": emitted / rounds if rounds else 0.0,
        "alpha": _ratio(sum(accepted), sum(accepted) + rejections),
        "accept_rate_per_position": [_share(p, o) for p, o in zip(passed, offered, strict=True)],
        "conditional_accept_rate_per_position": [
            _share(p, r) for p, r in zip(passed, reached, strict=True)
        ],
        "accepted_length_histogram": [sum(1 for a in accepted if a == n) for n in range(k + 1)],
        "rounds": rounds,
        "mean_drafted": _ratio(sum(drafted), rounds),
        "mean_depth": _ratio(sum(depths), rounds),
    }


EXPECTED_KEYS = ("expected_alpha", "expected_accept_rate_per_position", "expected_tau")


def expected_acceptance(gens: Sequence[Generation], k: int) -> dict:
    """Acceptance computed from p and q along the decoded text (sampled chain rounds only):
    ``beta_i = sum_x min(p_i, q_i)`` is position i's acceptance probability given the draft
    before it, so ``prod_{j <= i} beta_j`` is the round's probability of accepting at least i
    tokens. Averaged over rounds these estimate accept@i and alpha with far less variance than
    the counted accepts (every round contributes a probability, not a 0/1 outcome).

    Returns:
        ``{"expected_alpha", "expected_accept_rate_per_position", "expected_tau"}``: alpha is
        the mean beta over all drafted positions; accept@i the mean of the products over the
        rounds that drafted position i (None where none did); tau ``1 + sum_i`` of the
        per-round products (the bonus token plus the expected accepted length). None where no
        round was sampled.
    """
    rounds = [r for g in gens for r in g.overlaps]
    if not rounds:
        return dict.fromkeys(EXPECTED_KEYS)
    betas = [b for r in rounds for b in r]
    products = []
    for r in rounds:
        run, acc = 1.0, []
        for b in r:
            run *= b
            acc.append(run)
        products.append(acc)
    per_position = []
    for i in range(k):
        reached = [p[i] for p in products if len(p) > i]
        per_position.append(_share(sum(reached), len(reached)))
    return {
        "expected_alpha": _ratio(sum(betas), len(betas)),
        "expected_accept_rate_per_position": per_position,
        "expected_tau": 1 + _ratio(sum(sum(p) for p in products), len(products)),
    }


def timing(method: Sequence[Generation], baseline: Sequence[Generation]) -> dict:
    """Throughput of method and baseline over the same prompts, and where the time went."""
    m_tokens = sum(len(g.tokens) for g in method)
    b_tokens = sum(len(g.tokens) for g in baseline)
    m_seconds = sum(g.seconds for g in method)
    b_seconds = sum(g.seconds for g in baseline)
    m_rounds = sum(len(g.round_seconds) for g in method)
    b_rounds = sum(len(g.round_seconds) for g in baseline)
    round_seconds = sum(sum(g.round_seconds) for g in method)
    forwards = sum(g.target_forward_seconds + g.draft_forward_seconds for g in method)
    prefill = sum(g.prefill_seconds for g in method)
    tps = _ratio(m_tokens, m_seconds)
    base_tps = _ratio(b_tokens, b_seconds)
    return {
        "tokens_per_second": tps,
        "baseline_tokens_per_second": base_tps,
        "speedup": _ratio(tps, base_tps),
        "new_tokens": m_tokens,
        "baseline_new_tokens": b_tokens,
        "seconds": m_seconds,
        "baseline_seconds": b_seconds,
        "draft_seconds_per_round": _ratio(sum(sum(g.draft_seconds) for g in method), m_rounds),
        "verify_seconds_per_round": _ratio(sum(sum(g.verify_seconds) for g in method), m_rounds),
        "target_step_seconds": _ratio(sum(sum(g.round_seconds) for g in baseline), b_rounds),
        # time in rounds spent outside model forwards (sampling, verification, bookkeeping)
        "overhead_fraction": _ratio(round_seconds + prefill - forwards, round_seconds + prefill),
        # compacting the target's cache to the kept tokens (a tree's path), share of the rounds
        "keep_fraction": _ratio(sum(sum(g.keep_seconds) for g in method), round_seconds),
    }


def speedup_bound(alpha: float, k: float, c: float, v: float) -> float:
    """Expected speedup of chain drafting with per-token acceptance ``alpha`` (Leviathan et
    al. 2023, Theorem 3.8, with the verify forward costing ``v`` target steps)."""
    if k <= 0:
        return 1.0 / v if v > 0 else 0.0
    expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c + v)


def greedy_identity(method: Sequence[Generation], baseline: Sequence[Generation]) -> dict:
    """Token-for-token agreement of method and baseline outputs (meaningful at T = 0)."""
    identical = [m.tokens == b.tokens for m, b in zip(method, baseline, strict=True)]
    divergences = []
    for i, (m, b) in enumerate(zip(method, baseline, strict=True)):
        pos = _first_difference(m.tokens, b.tokens)
        if pos is not None:
            divergences.append({"prompt": i, "position": pos})
    return {"greedy_match_rate": _ratio(sum(identical), len(identical)), "divergences": divergences}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _share(num: float, den: float) -> float | None:
    """A rate over ``den`` cases; None when there were none."""
    return num / den if den else None
