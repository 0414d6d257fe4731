"""The mtp family (DeepSeek-V3-style multi-token-prediction modules on a frozen target): the
start from the target's read-out, the teacher, cached decoding against the training forward,
exact decoding (greedy identity on both sessions, the sampling certificate) and checkpoints.
Tiny random Llama and Qwen2 targets."""

from __future__ import annotations

import pytest
import teachers
import tiny_models
import torch
from test_medusa import SESSIONS, last_hidden
from test_tree import QUESTION, greedy_reference

from specdec import drafters
from specdec.decoding.sampling import SamplingParams, probabilities
from specdec.decoding.speculative import generate
from specdec.drafters.mtp import MTPConfig
from specdec.errors import ConfigError, ModelError
from specdec.scoring.certificate import sampling_certificate
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget
from specdec.training.setup import adamw


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def modules(target, seed: int = 0, scale: float = 0.05, **cfg):
    """Modules with every weight perturbed (so the layers, eh_proj and norms all matter)."""
    torch.manual_seed(seed)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, MTPConfig(**cfg), counts)
    with torch.no_grad():
        for p in drafter.module.parameters():
            p.add_(scale * torch.randn_like(p))
    return drafter


@pytest.mark.parametrize("build", [tiny_models.tiny_llama, tiny_models.tiny_qwen2])
def test_fresh_modules_read_out_as_the_target_does(build):
    """Every fresh module predicts what the target's own head does (so it starts from the
    target's next token), through a final norm whose weights are not 1."""
    model, tokenizer = build()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(3))
    target = FrozenTarget(model, tokenizer, name="tiny")
    drafter = drafters.build(target, MTPConfig(num_modules=3))
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        logits = drafter.module(ids, None, [out.hidden_states[-1]])
    assert logits.shape == (3, 2, 9, target.vocab_size)
    for s in range(3):
        # (up to the norms' epsilon, which the tiny model's small activations feel)
        torch.testing.assert_close(logits[s], out.logits, atol=2e-3, rtol=1e-2)
        assert torch.equal(logits[s].argmax(-1), out.logits.argmax(-1))


def test_teacher_of_module_k_is_the_target_k_plus_one_ahead(target):
    drafter = modules(target, num_modules=2)
    logits = torch.randn(1, 8, target.vocab_size, generator=torch.Generator().manual_seed(1))
    teacher = drafter.teacher(logits, torch.ones(1, 8))
    log_p = torch.log_softmax(logits, -1)
    for s in range(2):  # module s + 1 at row t predicts token t + s + 2: target row t + s + 1
        log_p_s = teachers.grid(teacher, s)[0]
        torch.testing.assert_close(log_p_s[0, : 8 - 2 - s], log_p[0, 1 + s : 7])
        assert teacher.mask[s, 0].tolist() == [True] * (8 - 2 - s) + [False] * (2 + s)


#: how far a proposal's q may be from the training forward's, per decoding forward, in total
#: variation: float32 paths compute the same thing; float16 rounds the weights and activations
#: (measured: at most 0.006 on these models; a copy with stale weights is 0.05-0.98 away)
FORWARD_TOLERANCE = {"float32": 1e-5, "transformers": 1e-5, "float16": 0.01}


@pytest.mark.parametrize("forward", list(FORWARD_TOLERANCE))
@pytest.mark.parametrize("vocab", [None, 60])
def test_cached_drafts_are_the_training_forward_on_the_drafted_sequence(target, vocab, forward):
    """After some decoding (so the modules have caught up with committed rounds), a sampled
    proposal's q_j is module j's distribution at the last verified row of the training
    forward over the sequence followed by the draft."""
    drafter = modules(target, num_modules=3, draft_vocab_size=vocab, scale=0.3)
    drafter.configure(forward)
    _assert_drafts_follow_training_forward(drafter, target, FORWARD_TOLERANCE[forward])


@pytest.mark.parametrize("vocab", [None, 60])
def test_float16_copy_follows_an_optimizer_step(target, vocab):
    """The float16 copy the modules decode with is made again once training has changed the
    weights, and neither the trained modules nor the target's borrowed head change dtype."""
    drafter = modules(target, num_modules=2, draft_vocab_size=vocab, scale=0.3)
    drafter.configure("float16")
    _assert_drafts_follow_training_forward(drafter, target, FORWARD_TOLERANCE["float16"])
    # a step of the training loop's own optimizer (fused on a CPU: one kernel writes the
    # weights in place, which by itself leaves their version counters as they were)
    trained = [p for p in drafter.module.parameters() if p.requires_grad]
    optimizer = adamw(trained, lr=0.3, weight_decay=0.0, device=torch.device("cpu"))
    for p in trained:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    optimizer.step()
    _assert_drafts_follow_training_forward(drafter, target, FORWARD_TOLERANCE["float16"])
    assert all(p.dtype == torch.float32 for p in drafter.module.parameters())
    assert target.model.get_output_embeddings().weight.dtype == torch.float32


def _assert_drafts_follow_training_forward(drafter, target, tolerance) -> None:
    steps = drafter.steps
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    session = SESSIONS["transformers"](target.model, hidden_layers=drafter.required_target_layers)
    out = generate(session, prompt, drafter=drafter, k=steps, max_new_tokens=9)
    sequence = prompt + out.tokens
    params = SamplingParams(temperature=1.0)
    proposal = drafter.propose(sequence, steps, params, torch.Generator().manual_seed(0))
    assert len(proposal) == steps
    ids = sequence + proposal.tokens.tolist()
    h = last_hidden(target, ids)[None]
    with torch.no_grad():
        logits = drafter.module(torch.tensor([ids]), None, [h])  # [S, 1, T, D]
    for j in range(steps):
        q = probabilities(logits[j, 0, len(sequence) - 2].float(), params)
        if drafter.draft_ids is not None:
            q = torch.zeros(target.vocab_size).index_put_((drafter.draft_ids,), q)
        assert 0.5 * float((proposal.probs[j] - q).abs().sum()) <= tolerance


def fitted(target, prompt: list[int], continuation: list[int]):
    """Modules fitted to the target's greedy continuation: module k at row t learns token
    t + k + 1, so drafts are often right, not always."""
    drafter = modules(target, num_modules=3)
    ids = torch.tensor([prompt + continuation])
    h = last_hidden(target, ids[0].tolist())[None]
    optimizer = torch.optim.Adam(drafter.module.parameters(), lr=3e-3)
    for _ in range(100):
        logits = drafter.module(ids, None, [h])
        loss = sum(
            torch.nn.functional.cross_entropy(logits[s, 0, : -2 - s], ids[0, 2 + s :])
            for s in range(3)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter


@pytest.mark.parametrize("session", list(SESSIONS))
def test_greedy_decoding_is_token_identical(target, session):
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    expected = greedy_reference(target.model, prompt, 40)
    drafter = fitted(target, prompt, expected)
    s = SESSIONS[session](target.model, hidden_layers=drafter.required_target_layers)
    got = generate(s, prompt, drafter=drafter, k=3, max_new_tokens=40)
    assert got.tokens == expected
    assert sum(got.accepted) > 0 and max(got.depths) == 3


def test_sampling_passes_the_certificate():
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # a peaked law, as a trained model's
    sharp = FrozenTarget(model, tokenizer, name="tiny-sharp")
    prompt = tokenizer("The quick brown fox")["input_ids"]
    drafter = fitted(sharp, prompt, greedy_reference(model, prompt, 12))
    prompts = [prompt, tokenizer("def add(a, b):")["input_ids"]]
    result = sampling_certificate(
        model, None, drafter, prompts, 6_000, k=3, new_tokens=3
    )  # the fitted heads know 12 tokens
    assert result["passed"] and result["p_value"] > 1e-3, result
    assert result["dof"] >= 100 and 0.05 < result["accept_rate"] < 0.98, result


@pytest.mark.parametrize("vocab", [None, 50])
def test_checkpoint_round_trip_and_another_target_refused(target, vocab, tmp_path):
    drafter = modules(target, num_modules=2, draft_vocab_size=vocab)
    path = drafter.save(tmp_path / "ckpt", target_name=target.name)
    loaded = drafters.load(path, target)
    ids = torch.randint(0, target.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    h = torch.randn(1, 7, target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(ids, None, [h]), drafter.module(ids, None, [h]))
    assert loaded.steps == 2 and (vocab is None) == (loaded.draft_ids is None)
    config = type(target.model.config).from_dict(target.model.config.to_dict())
    config.hidden_size, config.intermediate_size = 48, 96
    wider = FrozenTarget(type(target.model)(config).eval(), target.tokenizer, name="wider")
    with pytest.raises(ModelError, match="made for a target with hidden size 32"):
        drafters.load(path, wider)


@pytest.mark.parametrize("family", ["mtp", "eagle3"])
def test_an_unknown_draft_forward_is_refused(target, family):
    drafter = drafters.build(target, drafters.config_classes()[family]())
    with pytest.raises(ConfigError, match="draft forward 'fp8': expected one of auto, "):
        drafter.configure("fp8")
