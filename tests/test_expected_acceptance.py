"""Acceptance computed from p and q along the decoded text (``Generation.overlaps`` and
``metrics.expected_acceptance``) against closed forms on first-order Markov chains.

With a Markov target and drafter the acceptance probability of a draft token after token s is
``sum_x min(P[s, x], Q[s, x])``, computed here with numpy from the logit tables (not through
the library's ``probabilities``), so every recorded overlap can be checked exactly and the
expected accept@1 compared with the counted one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from markov import GreedyMarkovDrafter, MarkovDrafter, MarkovTarget, nearby_table, random_table

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.speculative import generate
from specdec.scoring.metrics import acceptance, expected_acceptance

VOCAB = 12
L_P = random_table(VOCAB, seed=5)
L_Q = nearby_table(L_P, seed=6)


def softmax_rows(table: torch.Tensor) -> np.ndarray:
    x = table.double().numpy()
    x = np.exp(x - x.max(axis=1, keepdims=True))  # exp(-inf) = 0 for the dropped entries
    return x / x.sum(axis=1, keepdims=True)


def decode(drafter, tokens: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    out = generate(
        MarkovTarget(L_P),
        [0],
        drafter=drafter,
        k=k,
        max_new_tokens=tokens,
        params=SamplingParams(temperature=1.0),
        generator=generator,
    )
    return out


def test_overlaps_are_the_min_sums_of_p_and_q_at_every_drafted_position():
    p, q = softmax_rows(L_P), softmax_rows(L_Q)
    drafter = MarkovDrafter(L_Q)
    drafts = []
    real = drafter.propose

    def recording(sequence, k, params, generator=None):
        proposal = real(sequence, k, params, generator)
        drafts.append([sequence[-1], *proposal.tokens.tolist()])
        return proposal

    drafter.propose = recording
    out = decode(drafter, tokens=400, k=3)
    assert len(out.overlaps) == len(drafts) == len(out.drafted)
    for chain, overlaps in zip(drafts, out.overlaps, strict=True):
        expected = [np.minimum(p[s], q[s]).sum() for s in chain[:-1]]  # the row before each
        assert overlaps == pytest.approx(expected, abs=1e-6)


def test_a_deterministic_draft_overlaps_by_the_targets_probability_of_its_token():
    p = softmax_rows(L_P)
    drafter = GreedyMarkovDrafter(L_Q, stop=(3,))
    out = decode(drafter, tokens=300, k=2)
    sequence, position = [0, *out.tokens], 1
    recorded, expected = iter(out.overlaps), []
    for drafted, accepted in zip(out.drafted, out.accepted, strict=True):
        # a greedy Markov draft follows the argmax chain of Q from the token before the round
        s, chain = sequence[position], []
        for _ in range(drafted):
            nxt = int(L_Q[s].argmax())
            chain.append(p[s, nxt])
            s = nxt
        if drafted:  # a round with an empty draft records nothing
            assert next(recorded) == pytest.approx(chain, abs=1e-6)
            expected.append(chain)
        position += accepted + 1
    assert next(recorded, None) is None
    assert len(expected) > 50 and len(expected) < len(out.drafted), "no empty drafts seen"


def test_expected_accept_at_one_agrees_with_the_counted_rate():
    out = decode(MarkovDrafter(L_Q), tokens=20_000, k=2, seed=1)
    counted = acceptance([out], 2)["accept_rate_per_position"][0]
    expected = expected_acceptance([out], 2)
    rounds = len(out.drafted)
    # counted accept@1 is a mean of Bernoulli(beta) draws: within 4 standard errors of the
    # mean beta (the expected value is itself exact given the contexts)
    error = (counted * (1 - counted) / rounds) ** 0.5
    assert abs(counted - expected["expected_accept_rate_per_position"][0]) < 4 * error
    # alpha here is the mean beta over all drafted positions, accept@2 the mean product
    betas = [b for r in out.overlaps for b in r]
    assert expected["expected_alpha"] == pytest.approx(np.mean(betas))
    products = [r[0] * r[1] for r in out.overlaps if len(r) > 1]
    assert expected["expected_accept_rate_per_position"][1] == pytest.approx(np.mean(products))
    firsts = [r[0] + (r[0] * r[1] if len(r) > 1 else 0.0) for r in out.overlaps]
    assert expected["expected_tau"] == pytest.approx(1 + np.mean(firsts))


def test_greedy_decoding_records_no_overlaps():
    generator = torch.Generator().manual_seed(0)
    out = generate(
        MarkovTarget(L_P), [0], drafter=GreedyMarkovDrafter(L_Q), k=3, max_new_tokens=50,
        generator=generator,
    )  # fmt: skip
    assert out.overlaps == []
    assert expected_acceptance([out], 3)["expected_alpha"] is None


def test_positions_never_drafted_have_no_rate():
    """Rounds that drafted one or two tokens (k = 4): positions 3 and 4 were never offered, so
    their rates are None (absent), not 0; the drafted positions' rates count by hand."""
    from specdec.decoding.speculative import Generation

    # three rounds: drafted 2 accepted 2, drafted 2 accepted 0, drafted 1 accepted 1
    gen = Generation(
        tokens=list(range(6)), drafted=[2, 2, 1], depths=[2, 2, 1], accepted=[2, 0, 1],
        overlaps=[[0.9, 0.5], [0.2, 0.1], [0.7]],
    )  # fmt: skip
    counted = acceptance([gen], 4)
    assert counted["accept_rate_per_position"] == [2 / 3, 1 / 2, None, None]
    assert counted["conditional_accept_rate_per_position"] == [2 / 3, 1 / 1, None, None]
    expected = expected_acceptance([gen], 4)["expected_accept_rate_per_position"]
    assert expected[:2] == pytest.approx([(0.9 + 0.2 + 0.7) / 3, (0.45 + 0.02) / 2])
    assert expected[2:] == [None, None]
