"""The losslessness certificates (specdec.scoring.certificate) on a tiny random Llama target.

A random tiny model's next-token law is nearly uniform over its 384 tokens (logits of std
~0.1), which leaves no context with enough draws to test; its head is scaled up 25x so that a
few tokens carry most of the mass (entropy ~2 nats), as in a trained model. The drafter is the
real draft_model family built from the target (one of its two layers), so it agrees with the
target often but not always (acceptance ~0.8): accepted drafts, residual resamples and bonus
tokens all occur. Seeds are fixed, so every outcome here is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
import torch
from markov import reference_law
from scipy.stats import chi2, kstest, kstwobign

from specdec import drafters
from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelConfig, build_draft_model
from specdec.drafters.eagle3 import Eagle3Config
from specdec.scoring.certificate import (
    TIE_MARGIN,
    PromptOnce,
    _draw,
    chi2_sf,
    exact_probabilities,
    greedy_certificate,
    kolmogorov_sf,
    ks_uniform,
    pearson,
    pit_values,
    sampling_certificate,
    tie_margin_for,
)
from specdec.target import FrozenTarget

TEXTS = ["The quick brown fox", "def add(a, b):", "Hello! How are", "The capital of"]
PASS_LEVEL = 1e-3
DETECT_LEVEL = 1e-6


@pytest.fixture(scope="module")
def setup():
    """(target model, prompt ids, a draft_model drafter built from the target)."""
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    target = FrozenTarget(model, tokenizer, name="tiny-sharp")
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    return model, prompts, drafter


class Wrapped(Drafter):
    """A drafter that changes what another one proposes."""

    def __init__(self, inner):
        self.inner = inner

    def begin(self, prompt, target_features=None):
        self.inner.begin(prompt, target_features)


class MisreportingDrafter(Wrapped):
    """A planted bug: drafts from q but reports q at twice the temperature (sqrt q, renormed)."""

    def propose(self, sequence, k, params, generator=None):
        proposal = self.inner.propose(sequence, k, params, generator)
        wrong = proposal.probs.sqrt()
        return Proposal(proposal.tokens, wrong / wrong.sum(-1, keepdim=True))


class GuessDrafter(Wrapped):
    """A deterministic drafter (no q): the draft model's argmax, as greedy drafting does."""

    def propose(self, sequence, k, params, generator=None):
        proposal = self.inner.propose(sequence, k, SamplingParams(), None)
        assert proposal.probs is None
        return proposal


def test_correct_drafter_passes(setup):
    model, prompts, drafter = setup
    result = sampling_certificate(model, None, drafter, prompts, 10_000, k=4, new_tokens=4)
    assert result["samples"] == 10_000 and result["prompts"] == 4
    assert result["passed"] and result["p_value"] > PASS_LEVEL, result
    # t1 per prompt, t2 per (prompt, t1), t3 per (prompt, t1, t2): many contexts tested
    assert result["groups_tested"] >= 50 and result["dof"] >= 200, result
    assert result["context_p_value"] > PASS_LEVEL
    # every token of every draw is transformed; their mean is a uniform's within ~4 sigma
    pit = result["pit"]
    assert pit["tokens"] == result["tokens"] == 40_000 and pit["p_value"] > PASS_LEVEL, pit
    assert abs(pit["mean_u"] - 0.5) < 4 * (1 / 12 / 40_000) ** 0.5, pit
    assert 0.2 < result["accept_rate"] < 0.98, result  # both acceptance and rejection occur
    assert result["outside_support"] == 0


def test_misreported_q_fails(setup):
    """Same target, prompts and drafter, but the reported q is not the one drafted from; a
    fifth of the draws already detects it (more draws only add power), and each of the two
    tests detects it on its own."""
    model, prompts, drafter = setup
    result = sampling_certificate(
        model, None, MisreportingDrafter(drafter), prompts, 2_000, k=4, new_tokens=8
    )
    assert not result["passed"] and result["p_value"] < DETECT_LEVEL, result
    assert result["context_p_value"] < DETECT_LEVEL
    assert result["pit"]["p_value"] < DETECT_LEVEL, result["pit"]
    # q reported flatter than drafted: the target's likely tokens come out too often
    assert result["pit"]["mean_u"] < 0.5


def test_pit_alone_catches_the_bug_where_contexts_do_not_repeat(setup):
    """Draws of 24 tokens after 20 prompts, 25 draws each: too few draws per context for the
    chi-square past t1, enough tokens for the transform."""
    model, _, drafter = setup
    prompts = [[1 + (7 * i + j) % 300 for j in range(6)] for i in range(20)]
    result = sampling_certificate(
        model, None, MisreportingDrafter(drafter), prompts, 500, k=4, new_tokens=24
    )
    assert result["context_p_value"] > DETECT_LEVEL, result  # it misses the bug here
    assert result["pit"]["p_value"] < DETECT_LEVEL and not result["passed"], result
    clean = sampling_certificate(model, None, drafter, prompts, 500, k=4, new_tokens=24)
    assert clean["passed"] and clean["pit"]["p_value"] > PASS_LEVEL, clean


def test_pit_values_rank_by_probability():
    """U against a numpy transform: sort by probability, highest first, ties by token id."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(12, 0.5), size=200)
    p[:, 3] = p[:, 5]  # a tie: token 3 ranks before token 5
    p /= p.sum(1, keepdims=True)
    tokens = np.array([rng.choice(12, p=row) for row in p])
    tokens[:20] = 5
    got = pit_values(torch.tensor(p), torch.tensor(tokens), torch.Generator().manual_seed(3))
    v = torch.rand(200, generator=torch.Generator().manual_seed(3), dtype=torch.float64).numpy()
    expected = []
    for row, x, vi in zip(p, tokens, v, strict=True):
        order = sorted(range(12), key=lambda t: (-row[t], t))
        before = order[: order.index(x)]
        expected.append(row[before].sum() + vi * row[x])
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)


def test_ks_statistic_and_tail_match_scipy():
    u = torch.rand(5_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for sample in (u, u**1.05):
        assert ks_uniform(sample) == pytest.approx(kstest(sample.numpy(), "uniform").statistic)
    for x in (0.05, 0.3, 0.8, 0.99, 1.0, 1.36, 1.95, 3.0, 6.0):
        assert kolmogorov_sf(x) == pytest.approx(kstwobign.sf(x), rel=1e-9, abs=1e-300)


def test_deterministic_drafter_with_top_k_passes(setup):
    """probs None (one-hot q) under temperature and top-k: still the target's law."""
    model, prompts, drafter = setup
    result = sampling_certificate(
        model, None, GuessDrafter(drafter), prompts, 2_000, k=2, temperature=0.8, top_k=20,
        new_tokens=4,
    )  # fmt: skip
    assert result["passed"] and result["p_value"] > PASS_LEVEL, result
    assert 0.2 < result["accept_rate"] < 0.98, result
    assert result["outside_support"] == 0


def test_seeded_draws_are_deterministic(setup):
    model, prompts, drafter = setup
    runs = [sampling_certificate(model, None, drafter, prompts[:1], 100, k=4) for _ in range(2)]
    other = sampling_certificate(model, None, drafter, prompts[:1], 100, k=4, seed=1)
    assert runs[0]["statistic"] == runs[1]["statistic"]
    assert other["statistic"] != runs[0]["statistic"]


def test_reference_is_the_models_own_law(setup):
    """The certificate's expected counts come from the model's logits, not from the decoder:
    a plain softmax at temperature 1, and an independent numpy law with temperature, top-k
    and top-p (``markov.reference_law``)."""
    model, prompts, _ = setup
    contexts = [prompts[0], prompts[1], prompts[0] + [7], prompts[0] + [9]]  # two lengths
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([c])).logits[0, -1] for c in contexts])
    plain = exact_probabilities(model, contexts, SamplingParams(temperature=1.0))
    assert plain.dtype == torch.float64
    torch.testing.assert_close(plain, logits.double().softmax(-1), atol=1e-6, rtol=1e-5)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    processed = exact_probabilities(model, contexts, params)
    np.testing.assert_allclose(processed.numpy(), reference_law(logits, params), atol=1e-6)


def test_pearson_merges_sparse_cells():
    observed = torch.tensor([30.0, 18.0, 2.0, 0.0, 1.0])
    expected = torch.tensor([25.0, 20.0, 3.0, 1.0, 1.0])
    # the cells expecting 1, 1 and 3 (5 together) become one cell observing 3
    statistic, dof = pearson(observed, expected)
    assert dof == 2
    assert statistic == pytest.approx(25 / 25 + 4 / 20 + 4 / 5)
    # merged cells still under 5 take in the next smallest cell
    statistic, dof = pearson(torch.tensor([30.0, 18.0, 2.0]), torch.tensor([25.0, 20.0, 3.0]))
    assert (statistic, dof) == (pytest.approx(25 / 25 + 9 / 23), 1)
    assert pearson(torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0])) is None


@pytest.mark.parametrize("dof", [1, 2, 7, 100, 1000])
def test_chi2_survival_matches_scipy(dof):
    for x in (0.1, dof * 0.5, dof, dof + 3 * (2 * dof) ** 0.5):
        assert chi2_sf(x, dof) == pytest.approx(chi2.sf(x, dof), rel=1e-9, abs=1e-300)


def test_greedy_identical_passes():
    result = greedy_certificate([], num_prompts=5)
    assert result == {"prompts": 5, "identical": 5, "near_ties": [], "failures": [], "passed": True}


def test_greedy_near_tie_is_explained():
    ties = [
        {"prompt": 1, "position": 40, "top2_margin": 3e-5},
        {"prompt": 3, "position": 7, "top2_margin": TIE_MARGIN},
    ]
    result = greedy_certificate(ties, num_prompts=5)
    assert result["passed"] and result["identical"] == 3
    assert result["near_ties"] == ties and result["failures"] == []


def test_greedy_large_margin_fails():
    tie = {"prompt": 0, "position": 3, "top2_margin": 1e-4}
    wide = {"prompt": 2, "position": 12, "top2_margin": 0.8}
    unmeasured = {"prompt": 4, "position": 1}
    result = greedy_certificate([tie, wide, unmeasured], num_prompts=5)
    assert not result["passed"] and result["identical"] == 2
    assert result["near_ties"] == [tie] and result["failures"] == [wide, unmeasured]
    # a bfloat16 target's noise floor is wider: 0.05 is a tie there, not in float32
    close = {"prompt": 0, "position": 3, "top2_margin": 0.05}
    assert greedy_certificate([close], 1, tie_margin_for(torch.bfloat16))["passed"]
    assert not greedy_certificate([close], 1, tie_margin_for(torch.float32))["passed"]


@pytest.mark.parametrize("family", ["draft_model", "eagle3"])
@pytest.mark.parametrize("forward", ["compact", "transformers"])
def test_prompt_read_once_draws_what_fresh_sessions_draw(setup, family, forward):
    """The certificate reads each prompt once (PromptOnce); its draws, seed for seed, equal
    those of a fresh session per draw, for a drafter that reads the target's features too.
    Two prompts, so the reuse is also dropped when the prompt changes."""
    model, prompts, drafter = setup
    if family == "eagle3":
        target = FrozenTarget(model, tiny_models.tiny_llama()[1], name="tiny-sharp")
        torch.manual_seed(0)
        drafter = drafters.build(
            target, Eagle3Config(draft_vocab_size=64), torch.ones(model.config.vocab_size)
        )
    layers = drafter.required_target_layers
    params = SamplingParams(temperature=1.0)
    seeds = list(range(40))
    reused = PromptOnce(target_session(model, forward, layers))
    for prompt in prompts[:2]:
        fresh = [
            _draw(target_session(model, forward, layers), drafter, prompt, [s], 4, params, 3)[0][0]
            for s in seeds
        ]
        draws, (drafted, accepted) = _draw(reused, drafter, prompt, seeds, 4, params, 3)
        assert draws == fresh
        assert drafted == len(seeds) and 0 < accepted < drafted  # rejections happen too
        assert len(set(draws)) > 10
