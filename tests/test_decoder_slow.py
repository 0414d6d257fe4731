"""Greedy exactness of the decoder on the real SmolLM2-135M target (fetched once, cached)."""

import pytest
import torch
from test_decoder import reference, truncated

from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters import DraftModelDrafter, PromptLookupDrafter
from specdec.scoring.run import encode_prompt
from specdec.target import eos_token_ids

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What are three tips for staying focused while studying?",
    "Write a Python function that returns the squares of a list of numbers.",
]


@pytest.fixture(scope="module")
def smollm2():
    from specdec.target import FrozenTarget

    return FrozenTarget.load("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def cases(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    eos = eos_token_ids(model, tokenizer)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return [(p, reference(model, p, 24, eos)) for p in prompts], eos


def useless(model):
    torch.manual_seed(0)
    small = truncated(model, 1)
    small.apply(small._init_weights)  # same shapes, random weights
    return small


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["perfect", "useless", "in_between", "prompt_lookup"])
def test_greedy_identical_on_smollm2(smollm2, cases, kind, k):
    model = smollm2.model
    vocab = model.config.vocab_size
    drafter = {
        "perfect": lambda: DraftModelDrafter(model, vocab, forward="transformers"),
        "useless": lambda: DraftModelDrafter(useless(model), vocab),
        "in_between": lambda: DraftModelDrafter(truncated(model, 4), vocab),
        "prompt_lookup": PromptLookupDrafter,
    }[kind]()
    examples, eos = cases
    session = ModelSession(model)
    for prompt, expected in examples:
        got = generate(session, prompt, drafter=drafter, k=k, max_new_tokens=24, eos_token_ids=eos)
        assert got.tokens == expected
        if kind == "perfect":
            assert all(a == d for a, d in zip(got.accepted, got.drafted, strict=True))


@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_eagle3_head_greedy_identical_on_smollm2(smollm2, cases, forward):
    """An EAGLE-3 head (untrained, reduced vocabulary) reads SmolLM2's hidden states through
    the compact target session; the output is the target's, token for token."""
    from specdec import drafters
    from specdec.decoding.compact import target_session
    from specdec.drafters.eagle3 import Eagle3Config

    torch.manual_seed(0)
    counts = torch.arange(smollm2.vocab_size, 0, -1).float()
    head = drafters.build(smollm2, Eagle3Config(draft_vocab_size=4096), counts)
    head.configure(forward, 0.0)
    assert head.required_target_layers == (1, 14, 26)
    examples, eos = cases
    session = target_session(smollm2.model, "auto", head.required_target_layers)
    for prompt, expected in examples:
        got = generate(session, prompt, drafter=head, k=4, max_new_tokens=24, eos_token_ids=eos)
        assert got.tokens == expected


STATIC = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_tree_decoding_greedy_identical_on_smollm2(smollm2, cases, tree):
    """Draft trees on the real target, through the transformers and the compact sessions:
    a draft model (SmolLM2's first 4 layers) and an untrained EAGLE-3 head, static and
    dynamic trees; the output is the target's, token for token."""
    from specdec import drafters
    from specdec.decoding.compact import target_session
    from specdec.drafters.eagle3 import Eagle3Config
    from specdec.drafters.tree import TreeSpec

    model = smollm2.model
    spec = TreeSpec("static", STATIC) if tree == "static" else TreeSpec("dynamic", 3, budget=10)
    torch.manual_seed(0)
    counts = torch.arange(smollm2.vocab_size, 0, -1).float()
    head = drafters.build(smollm2, Eagle3Config(draft_vocab_size=4096), counts)
    examples, eos = cases
    accepted = 0
    for drafter in (DraftModelDrafter(truncated(model, 4), model.config.vocab_size), head):
        drafter.configure("auto", 0.0, spec)
        for forward in ("transformers", "compact"):
            session = target_session(model, forward, drafter.required_target_layers)
            for prompt, expected in examples:
                got = generate(
                    session, prompt, drafter=drafter, k=4, max_new_tokens=24, eos_token_ids=eos
                )
                assert got.tokens == expected
                accepted += sum(got.accepted)
    assert accepted > 0
