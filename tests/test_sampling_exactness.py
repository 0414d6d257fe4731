"""Speculative sampling emits exactly the target's distribution: a statistical test.

The target and the drafters are first-order Markov chains (``tests/markov.py``), so the law of
each emitted token given the one before is known: ``reference_law(L_P, params)[s]`` (written
independently of the library's ``probabilities``). One long
sequence is decoded per configuration and its transition counts s -> t are compared with that
law by a chi-square test pooled over the previous token s (Anderson and Goodman 1957, "Statistical
inference about Markov chains"): the sum of the per-row statistics, with the sum of the per-row
degrees of freedom. Seeds are fixed, so the outcome is deterministic; the broken drafter below
shows that the test has the power to catch a lossy verifier at this sample size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from markov import (
    GreedyMarkovDrafter,
    MarkovDrafter,
    MarkovTarget,
    MislabelledDrafter,
    disjoint_table,
    nearby_table,
    random_table,
    reference_law,
)
from scipy.stats import chi2

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.speculative import generate
from specdec.decoding.verify import verify_sampling

VOCAB = 16
TOKENS = 100_000  # emitted tokens per configuration
MIN_EXPECTED = 5.0  # the usual validity rule of the chi-square approximation
PASS_LEVEL = 1e-3
DETECT_LEVEL = 1e-6

L_P = random_table(VOCAB, seed=1)
L_Q = nearby_table(L_P, seed=2)


def lump_sparse(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge the cells of one row whose expected count is under MIN_EXPECTED into one cell.

    If the merged cell is itself still under MIN_EXPECTED, the smallest remaining cell joins it,
    so every cell left has an expected count of at least MIN_EXPECTED (unless the whole row
    has less, when it becomes a single cell that carries no degree of freedom).
    """
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    m = int((expected < MIN_EXPECTED).sum())
    if m == 0:
        return observed, expected
    if expected[:m].sum() < MIN_EXPECTED and m < len(expected):
        m += 1
    observed = np.concatenate([[observed[:m].sum()], observed[m:]])
    expected = np.concatenate([[expected[:m].sum()], expected[m:]])
    return observed, expected


def transition_test(sequence: list[int], params: SamplingParams) -> dict:
    """Chi-square test of the transitions of ``sequence`` against the target's processed law.

    Each row s is tested on the support of p(. | s) after lumping sparse cells; a transition
    outside the support is counted apart (``outside``: it must be zero, not merely unlikely).

    Returns:
        ``{"statistic", "df", "pvalue", "outside"}``.
    """
    ids = np.asarray(sequence)
    counts = np.bincount(ids[:-1] * VOCAB + ids[1:], minlength=VOCAB * VOCAB)
    counts = counts.reshape(VOCAB, VOCAB).astype(np.float64)
    p = reference_law(L_P, params)
    statistic, df = 0.0, 0
    for s in range(VOCAB):
        support = p[s] > 0
        observed, expected = lump_sparse(counts[s, support], counts[s].sum() * p[s, support])
        if expected.sum() == 0:
            continue
        statistic += float(((observed - expected) ** 2 / expected).sum())
        df += len(expected) - 1
    return {
        "statistic": statistic,
        "df": df,
        "pvalue": float(chi2.sf(statistic, df)),
        "outside": int(counts[p == 0].sum()),
    }


def decode(drafter, params: SamplingParams, k: int, seed: int = 0, verify_lengths=None):
    """One sequence of TOKENS new tokens after the one-token prompt [0]."""
    target = MarkovTarget(L_P)
    generator = torch.Generator().manual_seed(seed)
    out = generate(
        target,
        [0],
        drafter=drafter,
        k=k,
        max_new_tokens=TOKENS,
        params=params,
        generator=generator,
        verify_lengths=verify_lengths,
    )
    sequence = [0] + out.tokens
    assert len(out.tokens) == TOKENS
    # the loop's invariant: the cache holds the whole sequence but its last token
    assert target.ids == sequence[:-1]
    return out, sequence


PLAIN = SamplingParams(temperature=1.0)
CONFIGS = {
    "baseline": (lambda: None, PLAIN, 1),
    "plain": (lambda: MarkovDrafter(L_Q), PLAIN, 4),
    "temperature": (lambda: MarkovDrafter(L_Q), SamplingParams(temperature=0.7), 1),
    "top_k": (lambda: MarkovDrafter(L_Q), SamplingParams(temperature=1.0, top_k=3), 3),
    "top_p": (lambda: MarkovDrafter(L_Q), SamplingParams(temperature=1.0, top_p=0.8), 3),
    "combined": (
        lambda: MarkovDrafter(L_Q),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        4,
    ),
    "one_hot_q": (lambda: GreedyMarkovDrafter(L_Q, stop=(3, 11)), PLAIN, 4),
    "disjoint": (lambda: MarkovDrafter(disjoint_table(L_P, seed=3)), PLAIN, 3),
    "p_equals_q": (lambda: MarkovDrafter(L_P), PLAIN, 4),
    # short drafts padded with deterministic guesses up to a cost-profile verify length
    "padded_one_hot": (lambda: GreedyMarkovDrafter(L_Q, stop=(3, 11)), PLAIN, 4, [1, 5, 5, 5, 5]),
    "padded_sampled": (lambda: ShortMarkovDrafter(L_Q), PLAIN, 4, [1, 5, 5, 5, 5]),
}


class ShortMarkovDrafter(MarkovDrafter):
    """Samples at most two tokens, leaving the rest of the verify length to padding."""

    def propose(self, sequence, k, params, generator=None):
        return super().propose(sequence, min(k, 2), params, generator)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_emitted_tokens_follow_target(name):
    make_drafter, params, k, *lengths = CONFIGS[name]
    out, sequence = decode(make_drafter(), params, k, verify_lengths=(lengths or [None])[0])
    result = transition_test(sequence, params)
    assert result["outside"] == 0, f"{name}: tokens emitted where p = 0: {result}"
    assert result["pvalue"] > PASS_LEVEL, f"{name}: emitted law differs from p: {result}"
    if name == "p_equals_q":
        rate = sum(out.accepted) / sum(out.drafted)
        assert rate > 0.999, f"q = p must accept (almost) every draft, accepted {rate:.4f}"
    if name == "disjoint":
        # from an even token every draft is rejected at once
        for previous, drafted, accepted in _rounds(sequence, out):
            if previous % 2 == 0 and drafted:
                assert accepted == 0


def _rounds(sequence: list[int], out):
    """(token before the round, drafted, accepted) for each round."""
    position = 1  # sequence index of the last token when the first round starts
    for drafted, accepted in zip(out.drafted, out.accepted, strict=True):
        yield sequence[position], drafted, accepted
        position += accepted + 1


def test_mislabelled_q_is_detected():
    """A drafter that reports the un-warped q while sampling after top-k: the test must fail."""
    params = SamplingParams(temperature=1.0, top_k=3)
    _, sequence = decode(MislabelledDrafter(L_Q), params, k=4)
    result = transition_test(sequence, params)
    assert result["pvalue"] < DETECT_LEVEL, result


def test_single_position_acceptance_rate():
    """verify_sampling at one position: P(accept) = sum_x min(p(x), q(x)), output ~ p."""
    trials = 100_000
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.3, 0.3])
    accept_rate = 0.2 + 0.2 + 0.2 + 0.0  # min(p, q) summed by hand
    generator = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, trials, replacement=True, generator=generator)
    p_rows = torch.stack([p, p])  # the draft position and the bonus position
    accepted, emitted = 0, np.zeros(4)
    for draft in drafts.view(-1, 1):
        n, tokens = verify_sampling(draft, q.view(1, -1), p_rows, generator)
        accepted += n
        emitted[tokens[0]] += 1
    standard_error = (accept_rate * (1 - accept_rate) / trials) ** 0.5
    assert abs(accepted / trials - accept_rate) < 4 * standard_error
    assert emitted[3] == 0
    expected = trials * p[:3].numpy()
    statistic = float(((emitted[:3] - expected) ** 2 / expected).sum())
    assert chi2.sf(statistic, df=2) > PASS_LEVEL
