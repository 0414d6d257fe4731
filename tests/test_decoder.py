"""Greedy exactness of the chain decoder on tiny random models.

Whatever the drafter proposes, greedy speculative decoding must emit exactly the tokens of
``generate(do_sample=False)``; only how many target forwards it takes may change.
"""

import copy

import pytest
import tiny_models
import torch

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import cheapest_verify_lengths, generate
from specdec.drafters import DraftModelDrafter, PromptLookupDrafter
from specdec.scoring.run import encode_prompt
from specdec.target import eos_token_ids

QUESTIONS = [
    "Write a function that adds two numbers.",
    "Tell me about the sea and the sky, the sea and the sky.",
    "def fib(n):\n    return n",
]


def truncated(model, num_layers: int):
    """The target's first ``num_layers`` layers with its embeddings and head: a drafter that
    agrees with the target part of the time."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    small = type(model)(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    return small


def reference(model, prompt, max_new_tokens, eos):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def drafters(model, vocab):
    other, _ = (
        tiny_models.tiny_llama(seed=7)
        if "Llama" in type(model).__name__
        else (tiny_models.tiny_qwen2(seed=7))
    )
    return {
        "perfect": DraftModelDrafter(model, vocab, forward="transformers"),  # same numbers
        "random": DraftModelDrafter(other, vocab),
        "in_between": DraftModelDrafter(truncated(model, 1), vocab),
        "prompt_lookup": PromptLookupDrafter(),
    }


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_to_generate(tiny_model, k):
    model, tokenizer = tiny_model
    vocab = model.config.vocab_size
    eos = eos_token_ids(model, tokenizer)
    session = ModelSession(model)
    for name, drafter in drafters(model, vocab).items():
        for question in QUESTIONS:
            prompt = encode_prompt(tokenizer, [{"role": "user", "content": question}])
            expected = reference(model, prompt, 24, eos)
            got = generate(
                session, prompt, drafter=drafter, k=k, max_new_tokens=24, eos_token_ids=eos
            )
            assert got.tokens == expected, (name, question)
            if name == "perfect":
                full = [a for a, d in zip(got.accepted, got.drafted, strict=True) if d == k]
                assert full and all(a == k for a in full)  # every draft accepted: tau = k + 1


def test_perfect_draft_tau_is_k_plus_one(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    k, rounds = 4, 5
    got = generate(
        ModelSession(model),
        prompt,
        drafter=DraftModelDrafter(model, model.config.vocab_size, forward="transformers"),
        k=k,
        max_new_tokens=1 + rounds * (k + 1),
    )
    assert len(got.tokens) == 1 + rounds * (k + 1)
    assert got.drafted == [k] * rounds and got.accepted == [k] * rounds


def test_many_prompts_in_one_session_equal_one_at_a_time(tiny_qwen2):
    model, tokenizer = tiny_qwen2
    vocab = model.config.vocab_size
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS * 2]
    shared_session, shared = ModelSession(model), DraftModelDrafter(truncated(model, 1), vocab)
    together = [
        generate(shared_session, p, drafter=shared, k=3, max_new_tokens=20).tokens for p in prompts
    ]
    alone = [
        generate(
            ModelSession(model),
            p,
            drafter=DraftModelDrafter(truncated(model, 1), vocab),
            k=3,
            max_new_tokens=20,
        ).tokens
        for p in prompts
    ]
    assert together == alone


def test_eos_inside_a_draft_stops_exactly(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[1]}])
    free = reference(model, prompt, 30, [])
    stop = free[7]  # make a token the model emits mid-sequence the end of sequence
    expected = free[: free.index(stop) + 1]
    got = generate(
        ModelSession(model),
        prompt,
        drafter=DraftModelDrafter(model, 384),
        k=5,
        max_new_tokens=30,
        eos_token_ids=[stop],
    )
    assert got.tokens == expected and got.finished


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6, 7])
def test_max_new_tokens_inside_a_draft(tiny_llama, max_new_tokens):
    model, tokenizer = tiny_llama
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    got = generate(
        ModelSession(model),
        prompt,
        drafter=DraftModelDrafter(model, 384),
        k=5,
        max_new_tokens=max_new_tokens,
    )
    assert got.tokens == reference(model, prompt, max_new_tokens, [])
    assert sum(got.drafted) + 1 <= max_new_tokens  # no draft beyond the budget


def test_plain_decoding_is_one_token_per_round(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    got = generate(ModelSession(model), prompt, max_new_tokens=12)
    assert got.tokens == reference(model, prompt, 12, [])
    assert got.drafted == [0] * 11


def test_sampling_is_reproducible_with_a_seed(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    drafter = DraftModelDrafter(truncated(model, 1), 384)
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return generate(
            ModelSession(model),
            prompt,
            drafter=drafter,
            k=3,
            max_new_tokens=16,
            params=params,
            generator=gen,
        ).tokens

    assert run(3) == run(3)
    assert run(3) != run(4)  # it does sample: another seed, another text
    greedy = generate(ModelSession(model), prompt, max_new_tokens=16).tokens
    assert run(3) != greedy and run(4) != greedy


def test_k_below_one_is_refused(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(ValueError, match="k must be >= 1"):
        generate(ModelSession(model), [1, 2, 3], drafter=PromptLookupDrafter(), k=0)


def test_prompt_lookup_copies_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    seq = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert drafter.propose(seq, 3, SamplingParams()).tokens.tolist() == [9, 2, 5]
    assert drafter.propose([1, 2, 3], 3, SamplingParams()).tokens.tolist() == []


def test_prompt_lookup_copies_grow_while_accepted_whole():
    """A copy is 4 tokens at first, twice as long after each copy accepted whole (capped by
    the round's k, also for the next round's growth), and 4 again after a copy cut short or
    a round without one; with copy_start 0 every copy takes the whole k."""
    seq = list(range(1, 21)) + [1, 2, 3]  # (1, 2, 3) seen at 0: the copy is 4, 5, 6, ...
    cont, greedy = list(range(4, 21)), SamplingParams()
    drafter = PromptLookupDrafter(max_ngram=3)
    drafter.begin(seq)
    rounds = [  # (k, sequence, tokens the target accepts) -> the copy proposed
        ((16, seq, 4), cont[:4]),
        ((16, seq, 8), cont[:8]),  # accepted whole: doubled
        ((16, seq, 16), cont[:16]),
        ((16, seq, 3), cont[:16]),  # the cap is k, not 32
        ((16, seq, 4), cont[:4]),  # cut short before: back to 4
        ((16, [7, 8, 9], 0), []),  # no match
        ((16, seq, 4), cont[:4]),  # a round without a copy: back to 4
        ((2, seq, 2), cont[:2]),  # accepted whole, but k was 2: it grows to 4 at most
        ((16, seq, 4), cont[:4]),  # accepted whole: 8 next
    ]
    for (k, sequence, accepted), want in rounds:
        assert drafter.propose(sequence, k, greedy).tokens.tolist() == want, (k, want)
        drafter.commit(accepted)
    drafter.begin(seq)  # a new sequence starts at 4
    assert drafter.propose(seq, 16, greedy).tokens.tolist() == cont[:4]
    fixed = PromptLookupDrafter(max_ngram=3, copy_start=0)
    assert fixed.propose(seq, 16, greedy).tokens.tolist() == cont[:16]
    fixed.commit(0)
    assert fixed.propose(seq, 5, greedy).tokens.tolist() == cont[:5]
    with pytest.raises(ValueError, match="copy_start must be >= 0"):
        PromptLookupDrafter(copy_start=-1)


def test_growing_copies_stay_greedy_exact(tiny_llama):
    """Prompt lookup on a prompt that repeats the target's own greedy continuation: copies
    grow past 4 tokens, get accepted, and the output is plain greedy decoding's."""
    model, _ = tiny_llama
    session = ModelSession(model)
    base = [5, 17, 42, 8, 99, 23, 61]
    prompt = base + generate(session, base, max_new_tokens=40).tokens + base
    plain = generate(session, prompt, max_new_tokens=48)
    got = generate(session, prompt, drafter=PromptLookupDrafter(), k=12, max_new_tokens=48)
    assert got.tokens == plain.tokens
    assert max(got.drafted) > 4 and max(got.drafted) <= 12, got.drafted
    assert max(got.accepted) > 4, got.accepted


def test_cheapest_verify_lengths_follow_the_profile():
    # a CPU-like profile: 2 and 3 tokens cost more than 5
    profile = {1: 1.0, 2: 1.6, 3: 2.0, 4: 1.5, 5: 1.3}
    assert cheapest_verify_lengths(profile, 4) == [1, 5, 5, 5, 5]
    assert cheapest_verify_lengths({m: float(m) for m in range(1, 6)}, 4) == [1, 2, 3, 4, 5]


class ShortDrafter(DraftModelDrafter):
    """Proposes at most two tokens: what the decoder pads up to the verify length."""

    def propose(self, sequence, k, params, generator=None):
        return super().propose(sequence, min(k, 2), params, generator)


def test_padded_verification_stays_greedy_exact(tiny_llama):
    model, tokenizer = tiny_llama
    drafter = ShortDrafter(truncated(model, 1), model.config.vocab_size)
    for question in QUESTIONS:
        prompt = encode_prompt(tokenizer, [{"role": "user", "content": question}])
        got = generate(
            ModelSession(model),
            prompt,
            drafter=drafter,
            k=4,
            max_new_tokens=30,
            verify_lengths=[1, 5, 5, 5, 5],
        )
        assert got.tokens == reference(model, prompt, 30, [])
        assert set(got.drafted) <= {0, 1, 2}
