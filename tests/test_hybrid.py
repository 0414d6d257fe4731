"""The hybrid drafter (prompt lookup where the context has a continuation, a trained drafter
elsewhere): greedy decoding token-identical to plain decoding over a draft model and an EAGLE-3
head with both sources drafting, sampling exact by the chi-square test of
``test_sampling_exactness`` (and the test catches lookup tokens labelled with the inner q), the
inner drafter's state in step after prompt lookup's rounds, and building a hybrid by name."""

import pytest
import tiny_models
import torch
from markov import MarkovDrafter, MarkovTarget
from test_eagle3 import head
from test_sampling_exactness import DETECT_LEVEL, L_P, L_Q, PASS_LEVEL, transition_test

from specdec import drafters
from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.speculative import generate
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelConfig, DraftModelDrafter, build_draft_model
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.errors import ConfigError
from specdec.target import FrozenTarget

TEXTS = ["Tell me about the sea.", "def add(a, b):", "List three colors, please."]
LOOKUP = drafters.PromptLookupDrafter.name
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def inner_drafter(target, family: str) -> Drafter:
    """An untrained drafter of ``family`` for ``target``: a one-layer draft model copied from
    the target, or an EAGLE-3 head (reduced vocabulary) off its identity start."""
    if family == "draft_model":
        return build_draft_model(target, DraftModelConfig(num_layers=1))
    return head(target, draft_vocab_size=64)


def prompts(target, session):
    """Each text, and the text followed by its own greedy continuation and the text again:
    there prompt lookup finds the continuation to copy, elsewhere it rarely does."""
    for text in TEXTS:
        base = target.tokenizer(text)["input_ids"]
        yield base
        yield base + generate(session, base, max_new_tokens=8).tokens + base


class Recorder(Drafter):
    """Passes everything through to ``drafter`` and logs into the shared ``log``: ``(name,
    sequence, k, generator state before, proposal)`` for each proposal, ``("commit",
    num_accepted)`` for each commit and ``("begin", 0)`` for each sequence.

    Args:
        sampled: draft at temperature 1 from an own generator, whatever the decoding's
            params (a greedy verification takes any draft), so that q can be compared.
        commits: log its commits (one of two recorders sharing a log: a round's one).
    """

    def __init__(self, drafter: Drafter, log: list, sampled: bool = False, commits=True):
        self.drafter, self.log, self.name = drafter, log, drafter.name
        self.commits = commits
        self.required_target_layers = drafter.required_target_layers
        self.generator = torch.Generator().manual_seed(0) if sampled else None

    def __getattr__(self, name):  # what else the hybrid asks of it (prompt lookup's limit)
        return getattr(self.__dict__["drafter"], name)

    def configure(self, forward="auto", confidence=0.0, tree=None):
        self.drafter.configure(forward, confidence, tree)

    def begin(self, prompt, target_features=None):
        self.log.append(("begin", 0))
        self.drafter.begin(prompt, target_features)

    def propose(self, sequence, k, params, generator=None):
        if self.generator is not None:
            params, generator = SAMPLED, self.generator
        state = generator.get_state() if generator is not None else None
        proposal = self.drafter.propose(sequence, k, params, generator)
        self.log.append((self.name, list(sequence), k, state, proposal))
        return proposal

    def commit(self, num_accepted, target_features=None):
        if self.commits:
            self.log.append(("commit", num_accepted))
        self.drafter.commit(num_accepted, target_features)


@pytest.mark.parametrize("family", ["draft_model", "eagle3"])
def test_greedy_decoding_is_token_identical(target, family):
    """Plain greedy decoding's tokens, with prompt lookup and the inner drafter both drafting
    (k from 1 to 5, and 12, where copies can grow past 4)."""
    hybrid = drafters.hybrid(inner_drafter(target, family))
    session = target_session(target.model, "auto", hybrid.required_target_layers)
    for k, prompt in zip([1, 3, 5, 2, 4, 12], prompts(target, session), strict=True):
        plain = generate(session, prompt, max_new_tokens=32)
        spec = generate(session, prompt, drafter=hybrid, k=k, max_new_tokens=32)
        assert spec.tokens == plain.tokens, (family, k, prompt)
    rounds, accepted = hybrid.rounds_by_source, hybrid.accepted_by_source
    assert rounds[LOOKUP] > 0 and rounds[family] > 0, rounds
    assert accepted[LOOKUP] > 0, accepted  # copied tokens were accepted and committed
    assert hybrid.name == f"{LOOKUP}+{family}"


def fresh_proposal(target, inner, sequence, k, params, state) -> Proposal:
    """What a new drafter with ``inner``'s weights, that saw ``sequence`` all at once,
    proposes after it with the generator in ``state``."""
    generator = torch.Generator().set_state(state)
    if isinstance(inner, DraftModelDrafter):
        fresh = DraftModelDrafter(inner.model, inner.target_vocab_size, forward="float32")
        fresh.begin(sequence)
        return fresh.propose(sequence, k, params, generator)
    fresh = Eagle3Drafter(
        inner.model, inner.required_target_layers, inner.draft_ids, inner.vocab_size
    )
    fresh.configure("float32")
    session = target_session(target.model, "auto", inner.required_target_layers)
    session.extend(sequence[:-1])  # the target's features of all but the last token
    fresh.begin(sequence[:-1], session.hidden)
    return fresh.propose(sequence, k, params, generator)


def rounds_of(log: list) -> list[tuple[str | None, int]]:
    """``(who drafted, tokens accepted)`` per round of a :class:`Recorder` log (who: None
    when no budget was left; a new sequence is a ``(None, 0)`` round)."""
    rounds, source = [], None
    for name, *entry in log:
        if name in ("begin", "commit"):
            rounds.append((source, entry[0]))
            source = None
        else:
            source = name
    return rounds


@pytest.mark.parametrize("family", ["draft_model", "eagle3"])
def test_inner_drafter_stays_in_step(target, family):
    """Every round the inner drafter drafts, also right after prompt lookup got tokens
    accepted, it proposes what a fresh drafter proposes after the whole sequence: the same
    tokens drawn from the same q. (Greedy verification, which accepts lookup's copies of the
    target's own continuation; the inner drafter samples, so that q is compared.)"""
    inner, log = inner_drafter(target, family), []
    hybrid = HybridDrafter(
        Recorder(drafters.PromptLookupDrafter(), log, commits=False),
        Recorder(inner, log, sampled=True),
    )
    hybrid.configure("float32")  # no float16 copy: its rounding differs between the two
    session = target_session(target.model, "auto", hybrid.required_target_layers)
    outs = [
        generate(session, p, drafter=hybrid, k=4, max_new_tokens=24)
        for p in prompts(target, session)
    ]
    # committed every round, prompt lookup's included
    assert sum(1 for name, *_ in log if name == "commit") == sum(len(o.drafted) for o in outs)
    rounds = rounds_of(log)
    pairs = zip(rounds, rounds[1:], strict=False)
    # the inner drafter had to catch up with tokens that prompt lookup got accepted
    assert any(a == LOOKUP and n >= 2 and b == family for (a, n), (b, _) in pairs), rounds
    for name, *entry in log:
        if name == family:
            sequence, k, state, proposal = entry
            want = fresh_proposal(target, inner, sequence, k, SAMPLED, state)
            assert torch.equal(proposal.tokens, want.tokens), len(sequence)
            torch.testing.assert_close(proposal.probs, want.probs, atol=1e-7, rtol=1e-3)


def decode_in_chunks(drafter, params, chunks=100, tokens=200, context=64):
    """One Markov chain of ``chunks * tokens`` emitted tokens after [0], decoded ``tokens`` at
    a time after the last ``context`` ones (a Markov target's law reads the last token only,
    so every transition is the target's; prompt lookup searches a short context)."""
    target, generator = MarkovTarget(L_P), torch.Generator().manual_seed(0)
    sequence = [0]
    for _ in range(chunks):
        out = generate(
            target, sequence[-context:], drafter=drafter, k=4, max_new_tokens=tokens,
            params=params, generator=generator,
        )  # fmt: skip
        sequence += out.tokens
    return sequence


SAMPLING = {
    "plain": SAMPLED,
    "combined": SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampled_tokens_follow_the_target(name):
    params = SAMPLING[name]
    hybrid = drafters.hybrid(MarkovDrafter(L_Q), min_ngram=2)
    sequence = decode_in_chunks(hybrid, params)
    assert len(sequence) > 10_000
    rounds = hybrid.rounds_by_source
    assert rounds[LOOKUP] > 1000 and rounds[MarkovDrafter.name] > 1000, rounds
    result = transition_test(sequence, params)
    assert result["outside"] == 0, result
    assert result["pvalue"] > PASS_LEVEL, result


class InnerQHybrid(HybridDrafter):
    """A broken hybrid: prompt lookup's tokens verified against the inner drafter's q."""

    def propose(self, sequence, k, params, generator=None):
        own = self.inner.propose(sequence, k, params, generator)
        found = self.lookup.propose(sequence, k, params, generator)
        if len(found) >= min(self.min_match, k):
            return Proposal(found.tokens, own.probs[: len(found)])
        return own


def test_lookup_tokens_with_the_inner_q_are_caught():
    params = SAMPLING["plain"]
    broken = InnerQHybrid(drafters.PromptLookupDrafter(min_ngram=2), MarkovDrafter(L_Q))
    result = transition_test(decode_in_chunks(broken, params, chunks=50), params)
    assert result["pvalue"] < DETECT_LEVEL, result


def test_built_by_name(tiny_llama_dir, tmp_path):
    """``prompt_lookup+PATH`` loads a specdec checkpoint, ``prompt_lookup+draft_model:PATH`` a
    transformers model; the settings reach prompt lookup and the knobs the inner drafter."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny-llama")
    path = head(target, draft_vocab_size=64).save(tmp_path / "head", target_name=target.name)
    hybrid = drafters.hybrid(drafters.load(path, target), max_ngram=4)
    assert isinstance(hybrid.inner, Eagle3Drafter) and hybrid.name == f"{LOOKUP}+eagle3"
    assert hybrid.lookup.max_ngram == 4 and hybrid.min_match == 2
    assert hybrid.required_target_layers == hybrid.inner.required_target_layers
    hybrid.configure("float32", 0.4)
    assert (hybrid.forward, hybrid.confidence) == ("float32", 0.4)
    with pytest.raises(ConfigError, match="chains only"):
        hybrid.configure(tree=object())

    inner = drafters.from_model(str(tiny_llama_dir), target)
    hybrid = drafters.hybrid(inner, min_match=3, min_ngram=None)
    assert isinstance(hybrid.inner, DraftModelDrafter) and hybrid.min_match == 3
    with pytest.raises(ConfigError, match="unknown prompt lookup settings"):
        drafters.hybrid(hybrid.inner, ngram=2)
    with pytest.raises(ConfigError, match="min_match"):
        drafters.hybrid(hybrid.inner, min_match=0)


class Fixed(Drafter):
    """An inner drafter that always proposes token 99."""

    name = "fixed"

    def propose(self, sequence, k, params, generator=None):
        return Proposal(torch.tensor([99]))


@pytest.mark.parametrize(
    ("sequence", "min_ngram", "want"),
    [
        ([5, 6, 7, 8, 1, 2, 6, 7], 2, [8, 1, 2, 6]),  # 2-gram (6, 7) seen at 1: copied
        ([5, 6, 7, 8, 1, 2, 6, 7], 3, [99]),  # no earlier 3-gram: the inner drafter's
        ([5, 6, 7, 8, 1, 5, 6, 7], 3, [8, 1, 5, 6]),  # 3-gram (5, 6, 7) seen at 0
        ([5, 6, 7, 8, 1, 2, 3, 7], 1, [8, 1, 2, 3]),  # 1-gram (7) seen at 2
        ([5, 6, 7, 8, 1, 2, 3, 7], 2, [99]),
    ],
)
def test_matches_shorter_than_min_ngram_go_to_the_inner_drafter(sequence, min_ngram, want):
    """The hybrid's prompt lookup trusts matches of at least ``min_ngram`` tokens; after a
    shorter one the inner drafter proposes (k = 4)."""
    hybrid = drafters.hybrid(Fixed(), min_ngram=min_ngram)
    proposal = hybrid.propose(sequence, 4, SamplingParams())
    assert proposal.tokens.tolist() == want
    source = LOOKUP if want[0] != 99 else "fixed"
    assert hybrid.rounds_by_source == {source: 1}


def test_the_inner_drafters_rounds_restart_the_copy_length():
    """Copies grow while accepted whole (4, 8, 16 at k = 16); a round of the inner drafter,
    though it was accepted whole, starts them over at 4, as does a copy cut short."""
    hybrid = drafters.hybrid(Fixed())
    copy = list(range(1, 21)) + [1, 2, 3]  # (1, 2, 3) seen at 0: copies 4, 5, 6, ...
    # (7, 7, 7) seen at 1, but only one token follows it, too short a copy (under 2): the
    # inner drafter's [99], which the target accepts, as it would have the one token [7]
    other = [30, 7, 7, 7, 7]
    cont = list(range(4, 21))
    hybrid.begin(copy)
    rounds = [  # (sequence, tokens the target accepts) -> the proposal
        ((copy, 4), cont[:4]),
        ((copy, 8), cont[:8]),
        ((other, 1), [99]),
        ((copy, 4), cont[:4]),  # after the inner drafter's round: 4 again
        ((copy, 2), cont[:8]),
        ((copy, 0), cont[:4]),  # after a copy cut short: 4 again
    ]
    for (sequence, accepted), want in rounds:
        assert hybrid.propose(sequence, 16, SamplingParams()).tokens.tolist() == want, want
        hybrid.commit(accepted)
    assert hybrid.rounds_by_source == {LOOKUP: 5, "fixed": 1}
