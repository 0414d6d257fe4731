"""The medusa family (Medusa-1 heads): what the heads compute, the teacher they train on, exact
decoding (greedy identity on both sessions, chains and trees; the sampling certificate),
checkpoints and the two serving layouts. Tiny random Llama and Qwen2 targets."""

from __future__ import annotations

import json

import pytest
import teachers
import tiny_models
import torch
from safetensors.torch import load_file
from test_tree import QUESTION, greedy_reference

from specdec import drafters
from specdec.decoding import kernels
from specdec.decoding.compact import CompactSession
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters.medusa import MedusaConfig
from specdec.drafters.tree import TreeSpec
from specdec.errors import ModelError
from specdec.export import export
from specdec.scoring.certificate import sampling_certificate
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget

SESSIONS = {"transformers": ModelSession, "compact": CompactSession}
STATIC = TreeSpec("static", choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
DYNAMIC = TreeSpec("dynamic", top_k=3, budget=8)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def heads(target, seed: int = 0, scale: float = 0.5, **cfg):
    """Heads with every block weight perturbed (fresh ones are the identity)."""
    torch.manual_seed(seed)
    counts = torch.arange(target.vocab_size, 0, -1).float()  # reduced vocab: the low ids
    drafter = drafters.build(target, MedusaConfig(**cfg), counts)
    with torch.no_grad():
        for p in drafter.module.blocks.parameters():
            p.add_(scale * torch.randn_like(p))
    return drafter


def by_hand(drafter, target, h: torch.Tensor) -> torch.Tensor:
    """``[K, ..., D]``: each head's logits from hidden states h, written from the paper:
    h + SiLU(W h + b) per block, then the LM head (own, or the target's)."""
    out = []
    for block in drafter.module.blocks:
        x = h
        for res in block:
            x = x + torch.nn.functional.silu(x @ res.linear.weight.T + res.linear.bias)
        lm = drafter.module.lm_head
        weight = lm.weight if lm is not None else target.model.get_output_embeddings().weight
        out.append(x @ weight.T)
    return torch.stack(out)


def last_hidden(target, ids: list[int]) -> torch.Tensor:
    """The target's last hidden state (after the final norm) at every position of ``ids``."""
    with torch.no_grad():
        return target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


@pytest.mark.parametrize("vocab", [None, 50])
def test_fresh_heads_read_out_as_the_target_does(target, vocab):
    drafter = drafters.build(
        target, MedusaConfig(num_heads=3, draft_vocab_size=vocab), torch.ones(target.vocab_size)
    )
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        logits = drafter.module(ids, None, [out.hidden_states[-1]])
    want = out.logits if vocab is None else out.logits[..., drafter.draft_ids]
    assert logits.shape == (3, 2, 9, vocab or target.vocab_size)
    for s in range(3):
        torch.testing.assert_close(logits[s], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [None, 50])
def test_heads_and_drafts_are_what_the_paper_computes(target, vocab):
    """Training face: the module's logits are the hand-written heads'. Decoding face: after
    the prompt and one target token, head i drafts token i + 1 of the chain from the target's
    last hidden state at the last verified position (the one before the target's token)."""
    drafter = heads(target, num_heads=3, num_layers=2, draft_vocab_size=vocab)
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    h = last_hidden(target, prompt)
    with torch.no_grad():
        torch.testing.assert_close(
            drafter.module(None, None, [h[None]])[:, 0], by_hand(drafter, target, h)
        )
    session = ModelSession(target.model, hidden_layers=drafter.required_target_layers)
    session.extend(prompt)
    drafter.configure("float32")  # (the paper's arithmetic; float16 drafts are tested below)
    drafter.begin(prompt, session.hidden)
    sequence = prompt + [5]
    proposal = drafter.propose(sequence, 3, SamplingParams())
    best = by_hand(drafter, target, h[-1]).argmax(-1)
    ids = best if vocab is None else drafter.draft_ids[best]
    assert proposal.tokens.tolist() == ids.tolist()
    assert proposal.probs is None and proposal.parents is None
    assert len(drafter.propose(sequence, 2, SamplingParams())) == 2  # k below the heads
    assert len(drafter.propose(sequence, 7, SamplingParams())) == 3  # k above: K tokens
    # a round: the target verifies [5, a, b], accepts both and adds c; the heads then read
    # the target's state at b
    a, b, c = proposal.tokens[:2].tolist() + [7]
    session.extend([5, a, b])
    drafter.commit(2, session.hidden)
    after = drafter.propose(sequence + [a, b, c], 3, SamplingParams())
    best = by_hand(drafter, target, last_hidden(target, prompt + [5, a, b])[-1]).argmax(-1)
    assert after.tokens.tolist() == (best if vocab is None else drafter.draft_ids[best]).tolist()


@pytest.mark.parametrize("vocab", [None, 50])
@pytest.mark.parametrize("forward", ["float32", "float16", "auto"])
def test_drafts_in_each_dtype_are_the_heads_laws_and_follow_an_update(
    target, vocab, forward, monkeypatch
):
    """Sampled drafts carry q: at depth d, head d's softmax, written by hand from the trained
    float32 weights (float16 decoding, which ``auto`` is on a CPU where it is measured the
    faster: within 0.01 total variation); after an in-place change of the weights (an optimizer
    step) the drafts follow it, and neither the trained heads nor the target's head change dtype."""
    drafter = heads(target, num_heads=3, num_layers=2, draft_vocab_size=vocab)
    drafter.configure(forward)
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    h = last_hidden(target, prompt)[-1]
    session = ModelSession(target.model, hidden_layers=drafter.required_target_layers)
    session.extend(prompt)
    params = SamplingParams(temperature=1.0)
    if forward == "auto":  # measured on the host: here as where float16 is the faster
        monkeypatch.setattr(kernels, "fastest_dtype", lambda *args: torch.float16)
    halved = forward != "float32"
    tolerance = 0.01 if halved else 1e-5
    for _ in range(2):
        rng = torch.get_rng_state()
        drafter.begin(prompt, session.hidden)  # (a float16 copy is made here)
        assert torch.equal(torch.get_rng_state(), rng)  # and leaves training's draws alone
        proposal = drafter.propose(prompt + [5], 3, params, torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = torch.softmax(by_hand(drafter, target, h), -1)  # [K, D]
        if vocab is not None:
            want = torch.zeros(3, target.vocab_size).index_put_(
                (torch.arange(3)[:, None], drafter.draft_ids[None]), want
            )
        tv = 0.5 * (proposal.probs - want).abs().sum(-1)
        assert proposal.probs.shape == (3, target.vocab_size) and tv.max() <= tolerance, tv
        if halved:  # drafted in float16 indeed: its rounding moves q a little
            assert tv.max() > 1e-6
        with torch.no_grad():  # what an optimizer step does: the weights change in place
            for p in drafter.module.parameters():
                p.add_(0.3 * p.abs().mean() * torch.randn_like(p))
    assert all(p.dtype == torch.float32 for p in drafter.module.parameters())
    assert target.model.get_output_embeddings().weight.dtype == torch.float32


def test_a_chain_runs_only_the_heads_it_drafts_with(target):
    """The confidence stop saves the later heads' work: a chain asks head i only when it
    drafts depth i + 1."""
    drafter = heads(target, num_heads=4)
    ran = []
    for i, block in enumerate(drafter.module.blocks):
        block.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    session = ModelSession(target.model, hidden_layers=drafter.required_target_layers)
    session.extend(prompt)
    for confidence, want in ((1.0, [0]), (0.0, [0, 1, 2, 3])):
        drafter.configure("float32", confidence=confidence)  # (float32: the trained heads run)
        drafter.begin(prompt, session.hidden)
        ran.clear()
        proposal = drafter.propose(prompt + [5], 4, SamplingParams())
        assert ran == want and len(proposal) == len(want)


def test_teacher_of_head_s_is_the_target_two_plus_s_ahead(target):
    drafter = heads(target, num_heads=3)
    logits = torch.randn(2, 10, target.vocab_size, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10)
    mask[0, :4] = 0
    teacher = drafter.teacher(logits, mask)
    log_p = torch.log_softmax(logits, -1)
    for s in range(3):
        step_p = teachers.grid(teacher, s)[0]
        for t in range(10 - 2 - s):  # head s at row t predicts token t + 2 + s
            assert teacher.mask[s, :, t].tolist() == [bool(mask[0, t + 2 + s]), True]
            where = teacher.mask[s, :, t]
            torch.testing.assert_close(step_p[where, t], log_p[where, t + 1 + s])
        assert not teacher.mask[s, :, 10 - 2 - s :].any()
    assert drafter.step_weights().tolist() == pytest.approx([1.0, 0.8, 0.64])


def fitted(target, texts: list[tuple[list[int], list[int]]], vocab: int):
    """Heads fitted (a few hundred Adam steps) to the target's own greedy continuations of
    prompts (``(prompt, continuation)`` pairs): head s at row t learns token t + 2 + s, so
    drafts are often right, not always."""
    drafter = heads(target, num_heads=3, scale=0.05, draft_vocab_size=vocab)
    index = torch.full((target.vocab_size,), -100, dtype=torch.long)  # outside: not trained
    index[drafter.draft_ids] = torch.arange(vocab)
    rows = [(last_hidden(target, p + c)[None], index[torch.tensor(p + c)]) for p, c in texts]
    optimizer = torch.optim.Adam(drafter.module.parameters(), lr=1e-2)
    for _ in range(150):
        loss = 0
        for h, labels in rows:
            logits = drafter.module(None, None, [h])  # [S, 1, T, D]
            for s in range(3):
                loss = loss + torch.nn.functional.cross_entropy(
                    logits[s, 0, : -2 - s], labels[2 + s :]
                )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter


@pytest.mark.parametrize("tree", [None, STATIC, DYNAMIC], ids=["chain", "static", "dynamic"])
@pytest.mark.parametrize("session", list(SESSIONS))
def test_greedy_decoding_is_token_identical(target, session, tree):
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    expected = greedy_reference(target.model, prompt, 40)
    drafter = fitted(target, [(prompt, expected)], vocab=300)
    drafter.configure(tree=tree)
    s = SESSIONS[session](target.model, hidden_layers=drafter.required_target_layers)
    got = generate(s, prompt, drafter=drafter, k=3, max_new_tokens=40)
    assert got.tokens == expected
    assert sum(got.accepted) > 0
    if len(set(expected)) > 1:  # (tiny Qwen2 repeats one token, which the heads learn fully)
        assert sum(got.accepted) < sum(got.drafted)  # heads right and wrong both occur
    assert max(got.depths) == 3


@pytest.fixture(scope="module")
def sharp():
    """A tiny target whose next-token law is peaked (head x25), as a trained model's is."""
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return FrozenTarget(model, tokenizer, name="tiny-sharp")


@pytest.mark.parametrize("tree", [None, STATIC], ids=["chain", "static"])
def test_sampling_passes_the_certificate(sharp, tree):
    prompts = [sharp.tokenizer(t)["input_ids"] for t in ("The quick brown fox", "def add(a, b):")]
    texts = [(p, greedy_reference(sharp.model, p, 12)) for p in prompts]
    drafter = fitted(sharp, texts, vocab=300)
    drafter.configure(tree=tree)
    result = sampling_certificate(
        sharp.model, None, drafter, prompts, 6_000, k=3, new_tokens=3
    )  # the fitted heads know 12 tokens
    assert result["passed"] and result["p_value"] > 1e-3, result
    # hundreds of accepted drafts and of rejections among the 6,000 draws (a rate per drafted
    # node: the tree's first round drafts 3 siblings for one position)
    nodes = 1 if tree is None else 3
    assert result["dof"] >= 100 and 0.1 < nodes * result["accept_rate"] < 0.98, result


@pytest.mark.parametrize("vocab", [None, 50])
def test_checkpoint_round_trip_and_another_target_refused(target, vocab, tmp_path):
    drafter = heads(target, num_heads=2, num_layers=2, draft_vocab_size=vocab)
    path = drafter.save(tmp_path / "ckpt", target_name=target.name)
    saved = load_file(path / "model.safetensors")
    borrowed = target.model.get_output_embeddings().weight
    assert not any(t.shape == borrowed.shape for t in saved.values())  # the target's not saved
    loaded = drafters.load(path, target)
    h = torch.randn(4, target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(None, None, [h]), drafter.module(None, None, [h]))
    assert loaded.steps == 2 and loaded.decay == drafter.decay
    if vocab:
        assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    config = type(target.model.config).from_dict(target.model.config.to_dict())
    config.hidden_size, config.intermediate_size = 48, 96
    wider = FrozenTarget(type(target.model)(config).eval(), target.tokenizer, name="wider")
    with pytest.raises(ModelError, match="made for a target with hidden size 32"):
        drafters.load(path, wider)


@pytest.mark.parametrize("vocab", [None, 50])
@pytest.mark.parametrize("fmt", ["medusa", "vllm_medusa"])
def test_export_layouts_round_trip(target, fmt, vocab, tmp_path):
    drafter = heads(target, num_heads=3, num_layers=2, draft_vocab_size=vocab)
    ckpt = drafter.save(tmp_path / "ckpt", target_name=target.name)
    out = tmp_path / fmt
    if fmt == "medusa" and vocab:
        with pytest.raises(ModelError, match="full-vocabulary heads"):
            export(fmt, ckpt, out, target)
        assert not out.exists()
        return
    export(fmt, ckpt, out, target)
    config = json.loads((out / "config.json").read_text())
    head = target.model.get_output_embeddings().weight
    block = drafter.module.blocks[2][1].linear
    if fmt == "medusa":
        state = load_file(out / "medusa_lm_head.safetensors")
        assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
        assert torch.equal(state["2.1.linear.weight"], block.weight)
        assert all(torch.equal(state[f"{h}.2.weight"], head) for h in range(3))
    else:
        state = load_file(out / "model.safetensors")
        assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2
        assert config["truncated_vocab_size"] == (vocab or target.vocab_size)
        assert torch.equal(state["blocks.2.layers.1.bias"], block.bias)
        lm = drafter.module.lm_head.weight if vocab else head
        assert torch.equal(state["lm_heads.0.weight"], lm)
        assert ("token_map" in state) == bool(vocab)
        if vocab:
            assert torch.equal(state["token_map"], drafter.draft_ids)


def test_export_of_a_head_that_is_not_the_targets_is_refused(target, tmp_path, monkeypatch):
    """The verification reloads the files: a medusa export whose LM heads are not the target's
    (which specdec's heads read out through) fails and leaves nothing behind."""
    from specdec.drafters import medusa_layouts

    drafter = heads(target, num_heads=2)
    ckpt = drafter.save(tmp_path / "ckpt", target_name=target.name)
    real = medusa_layouts.export

    def wrong(drafter, fmt, target):
        config, state = real(drafter, fmt, target)
        return config, {k: v + 1 if k.endswith(".1.weight") else v for k, v in state.items()}

    monkeypatch.setattr(medusa_layouts, "export", wrong)
    with pytest.raises(ModelError, match="not the target's"):
        export("medusa", ckpt, tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
