"""The eagle3 family on tiny targets: training-time test equals cached decoding, the teacher's
step shift, exact greedy and sampled decoding (a reduced draft vocabulary included), the
vocabulary maps and checkpoints."""

import json
import re

import numpy as np
import pytest
import teachers
import tiny_models
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from specdec import drafters
from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.speculative import generate
from specdec.drafters.eagle3 import Eagle3Config, default_layers
from specdec.drafters.eagle3_model import DraftCache
from specdec.errors import ConfigError, ModelError
from specdec.target import FrozenTarget

PROMPTS = ["Tell me about the sea.", "def add(a, b):", "List three colors, please."]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def counts(target) -> torch.Tensor:
    """Token counts that make a reduced vocabulary of the low ids (plus the specials)."""
    return torch.arange(target.vocab_size, 0, -1).float()


def head(target, seed: int = 0, **cfg) -> drafters.Drafter:
    torch.manual_seed(seed)
    drafter = drafters.build(target, Eagle3Config(**cfg), counts(target))
    with torch.no_grad():  # leave the identity start: every weight matters in these tests
        for p in drafter.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter


def features(target, drafter, ids):
    out = target.forward(ids, hidden_layers=drafter.required_target_layers)
    return out, [out.hidden_states[i] for i in drafter.required_target_layers]


@torch.no_grad()
@pytest.mark.parametrize("steps", [3, 7])  # the default and the most the config allows
def test_training_time_test_equals_cached_decoding(target, steps):
    """Step s at row t of the unrolled training forward is the head decoding with its KV cache:
    the verified prefix entered from the target's features, then s entries of its own."""
    drafter = head(target, draft_vocab_size=64, ttt_steps=steps)
    model = drafter.module.eval()
    ids = torch.randint(0, target.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    _, feats = features(target, drafter, ids)
    unrolled = model(ids, torch.ones_like(ids), feats)  # [S, 1, 14, 64]
    assert unrolled.shape[0] == steps
    for t in [t for t in (0, 5, 9) if t + 1 + steps < 14]:
        cache = DraftCache(model, torch.float32)
        fused = model.fuse([f[0, : t + 1] for f in feats])
        x = model.decode(model.embedding(ids[0, 1 : t + 2]), fused, 0, cache)[-1:]
        for s in range(steps):
            torch.testing.assert_close(model.logits(x)[0], unrolled[s, 0, t], atol=1e-5, rtol=1e-4)
            token = ids[0, t + 2 + s : t + 3 + s]  # the data's token, as in training
            x = model.decode(model.embedding(token), x, t + 1 + s, cache)


@pytest.mark.parametrize("rows", ["every row", "rows read"])
def test_teacher_is_the_target_shifted_by_one_plus_step(target, rows):
    """The teacher from the target's logits at every row, or only at the rows some step
    reads (those before an answer's token, as the training step computes them)."""
    drafter = head(target, draft_vocab_size=64, ttt_steps=3)
    ids = torch.randint(0, target.vocab_size, (2, 9))
    logits = target.forward(ids).logits
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    if rows == "every row":
        teacher = drafter.teacher(logits, loss_mask)
    else:
        read = torch.zeros_like(loss_mask, dtype=torch.bool)
        read[:, :-1] = loss_mask[:, 1:].bool()
        teacher = drafter.teacher(logits[read], loss_mask, at=read)
    assert teacher.mask.shape == (3, 2, 9)
    ids_d = drafter.draft_ids
    full = torch.log_softmax(logits.float(), -1)
    for s in range(3):
        step_p = teachers.grid(teacher, s)[0]
        assert step_p.shape == (2, 9, 64)
        for t in range(9):
            # step s at row t predicts token t + 2 + s: the target's row t + 1 + s
            if t + 2 + s < 9:
                assert teacher.mask[s, :, t].tolist() == loss_mask[:, t + 2 + s].bool().tolist()
                where = teacher.mask[s, :, t]
                torch.testing.assert_close(step_p[where, t], full[where, t + 1 + s][:, ids_d])
            else:
                assert not teacher.mask[s, :, t].any()


def test_vocabulary_maps(target):
    from specdec.drafters import vocabulary

    drafter = head(target, draft_vocab_size=64)
    ids = drafter.draft_ids
    d2t, t2d = vocabulary.d2t(ids), vocabulary.t2d(ids, target.vocab_size)
    assert len(ids) == 64 and bool(t2d[torch.arange(64) + d2t].all())
    assert int(t2d.sum()) == 64
    assert torch.equal(vocabulary.from_d2t(d2t), ids)
    specials = set(target.tokenizer.all_special_ids)
    assert specials <= set(ids.tolist())


@pytest.mark.parametrize("forward", ["transformers", "auto"])
def test_greedy_decoding_is_token_identical(target, forward):
    drafter = _trained(target)
    session = target_session(target.model, forward, drafter.required_target_layers)
    accepted = 0
    for k, text in zip([1, 3, 5], PROMPTS, strict=True):
        prompt = target.tokenizer(text)["input_ids"]
        plain = generate(session, prompt, max_new_tokens=40)
        for confidence in (0.0, 0.5):
            drafter.configure("auto", confidence)
            spec = generate(session, prompt, drafter=drafter, k=k, max_new_tokens=40)
            assert spec.tokens == plain.tokens
            accepted += sum(spec.accepted)
    assert accepted > 10  # the accept path, and commits of several tokens, ran
    # a float16 decoding copy leaves the trained head (and its rotary tables) as they were
    assert all(p.dtype == torch.float32 for p in drafter.module.parameters())
    assert drafter.module.rotary.inv_freq.dtype == torch.float32


def _pit(model, session, drafter, prompt, params, seeds, temperature):
    """Randomised probability integral transforms of every emitted token under the target's
    law at its position (softmax of logits / T, computed here): uniform iff exact."""
    values = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        out = generate(
            session, prompt, drafter=drafter, k=3, max_new_tokens=12, params=params, generator=gen
        )
        ids = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        p = torch.softmax(logits / temperature, -1)
        cdf = torch.cumsum(p, -1)
        rows = torch.arange(len(out.tokens))
        x = torch.tensor(out.tokens)
        below = cdf[rows, x] - p[rows, x]
        u = torch.rand(len(x), generator=torch.Generator().manual_seed(10_000 + seed)).double()
        values += (below + u * p[rows, x]).tolist()
    return np.array(values)


def peaked_target() -> FrozenTarget:
    """The tiny Llama with its head scaled up: confident distributions, as trained models have
    (a random tiny model is nearly uniform, where any q passes the acceptance test)."""
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
    return FrozenTarget(model, tokenizer, name="tiny-peaked")


def _uniform_pvalue(values: np.ndarray, bins: int = 20) -> float:
    observed = np.histogram(values, bins=bins, range=(0, 1))[0]
    return float(chisquare(observed).pvalue)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_follow_the_target(temperature):
    target = peaked_target()
    drafter = _trained(target)
    session = target_session(target.model, "auto", drafter.required_target_layers)
    prompt = target.tokenizer(PROMPTS[0])["input_ids"]
    params = SamplingParams(temperature)
    values = _pit(target.model, session, drafter, prompt, params, range(600), temperature)
    assert len(values) >= 6000
    assert _uniform_pvalue(values) > 1e-3


def test_mislabelled_draft_distribution_is_caught(monkeypatch):
    """The same test fails when q is put back onto the wrong target ids: it has the power."""
    from specdec.drafters import vocabulary

    target = peaked_target()
    drafter = _trained(target)
    wrong = drafter.draft_ids.roll(1)
    real = vocabulary.to_target

    def mislabelled(q, draft_ids, size):
        return real(q, wrong, size)

    session = target_session(target.model, "auto", drafter.required_target_layers)
    prompt = target.tokenizer(PROMPTS[0])["input_ids"]
    monkeypatch.setattr(vocabulary, "to_target", mislabelled)
    values = _pit(target.model, session, drafter, prompt, SamplingParams(1.0), range(300), 1.0)
    assert _uniform_pvalue(values) < 1e-6


_TRAINED: dict = {}


def _trained(target):
    """A head fitted for a few hundred steps to the target's own greedy continuations (so
    it agrees with the target often enough for the accept paths to run), cached per target."""
    if target.name in _TRAINED:
        return _TRAINED[target.name]
    drafter = head(target, seed=3, draft_vocab_size=96, ttt_steps=2)
    model = drafter.module.train()
    rows = []
    for text in PROMPTS:
        prompt = target.tokenizer(text)["input_ids"]
        out = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )
        rows.append(out[0, :48])
    ids = torch.stack(rows)
    out, feats = features(target, drafter, ids)
    teacher = drafter.teacher(out.logits, torch.ones_like(ids))
    probs = [teacher.at(s)[0].exp() for s in range(drafter.steps)]  # [N_s, D] each
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        logits = model(ids, torch.ones_like(ids), feats)
        per_step = [
            -(p * torch.log_softmax(step[teacher.mask[s]], -1)).sum(-1)
            for s, (p, step) in enumerate(zip(probs, logits, strict=True))
        ]
        loss = torch.cat(per_step).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    _TRAINED[target.name] = drafter
    return drafter


def test_checkpoint_round_trip_and_refusals(target, tmp_path):
    drafter = head(target, draft_vocab_size=64, ttt_steps=2)
    path = drafter.save(tmp_path / "ckpt", target_name=target.name, extra={"step": 3})
    meta = json.loads((path / "drafter.json").read_text())
    assert meta["type"] == "eagle3" and meta["step"] == 3 and meta["draft_vocab_size"] == 64
    state = load_file(path / "model.safetensors")
    assert not any(k.startswith("embed") for k in state)  # the target's embedding is borrowed
    assert torch.equal(state["d2t"] + torch.arange(64), drafter.draft_ids)
    loaded = drafters.load(path, target)
    ids = torch.randint(0, target.vocab_size, (2, 10))
    _, feats = features(target, drafter, ids)
    with torch.no_grad():
        want = drafter.module.eval()(ids, None, feats)
        assert torch.equal(loaded.module.eval()(ids, None, feats), want)
    assert loaded.required_target_layers == drafter.required_target_layers

    without_map = {k: v for k, v in state.items() if k != "d2t"}
    save_file(without_map, path / "model.safetensors")
    with pytest.raises(ModelError, match="d2t"):
        drafters.load(path, target)
    del state["lm_head.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelError, match="lm_head.weight"):
        drafters.load(path, target)
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelError, match="unreadable"):
        drafters.load(path, target)


def test_checkpoint_of_another_target_is_refused(tmp_path):
    llama = FrozenTarget(*tiny_models.tiny_llama(), name="llama")
    drafter = head(llama)
    drafter.save(tmp_path / "ckpt", target_name="llama")
    config = tiny_models.tiny_llama()[0].config
    config.hidden_size, config.intermediate_size = 48, 96
    from transformers import LlamaForCausalLM

    wider = FrozenTarget(LlamaForCausalLM(config).eval(), llama.tokenizer, name="wider")
    with pytest.raises(ModelError, match="hidden size 32"):
        drafters.load(tmp_path / "ckpt", wider)


@pytest.mark.parametrize("start", ["built", "from_pretrained"])
def test_training_options_apply_to_a_loaded_head_too(target, tmp_path, start):
    """``feature_noise``, ``freeze_lm_head`` and ``recompute_attention`` are training options: a
    recipe that starts from a saved head gets them as one that builds a fresh head does."""
    cfg = {"draft_vocab_size": 64, "feature_noise": 0.3, "freeze_lm_head": True}
    cfg["recompute_attention"] = True
    if start == "from_pretrained":
        head(target, draft_vocab_size=64).save(tmp_path / "ckpt", target_name=target.name)
        cfg["from_pretrained"] = str(tmp_path / "ckpt")
    rows = {"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}
    drafter = drafters.for_recipe(Eagle3Config(**cfg), target, rows)
    model = drafter.module
    assert model.feature_noise == 0.3 and model.recompute_attention
    assert not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "lm_head.weight")


@torch.no_grad()
def test_a_loaded_head_trains_on_with_the_recipes_training_time_test(target, tmp_path):
    """One step of training-time test first, then three from it: a head loaded through
    ``drafter.from_pretrained`` unrolls the recipe's ``ttt_steps`` with its step weights, not
    the saved run's, and its weights are the saved ones."""
    first = head(target, draft_vocab_size=64, ttt_steps=1)
    first.save(tmp_path / "ckpt", target_name=target.name)
    cfg = Eagle3Config(draft_vocab_size=64, ttt_steps=3, step_weight_decay=0.5,
                       from_pretrained=str(tmp_path / "ckpt"))  # fmt: skip
    drafter = drafters.for_recipe(cfg, target, {"input_ids": [[1, 2]], "loss_mask": [[0, 1]]})
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    _, feats = features(target, first, ids)
    before = first.module.eval()(ids, torch.ones_like(ids), feats)
    after = drafter.module.eval()(ids, torch.ones_like(ids), feats)
    assert before.shape[0] == 1 and after.shape[0] == 3
    torch.testing.assert_close(after[0], before[0])
    assert drafter.step_weights().tolist() == [1.0, 0.5, 0.25]
    drafter.save(tmp_path / "next", target_name=target.name)
    assert drafters.load(tmp_path / "next", target).steps == 3


@pytest.mark.parametrize(
    "key, value, held",
    [("num_layers", 2, "1"), ("draft_vocab_size", 32, "64"), ("draft_vocab_size", None, "64"),
     ("target_layers", [1], "[0, 1]")],
)  # fmt: skip
def test_a_loaded_head_refuses_a_recipe_of_another_shape(target, tmp_path, key, value, held):
    """A recipe whose head shape differs from the checkpoint it starts from is refused, naming
    the key, rather than trained in the checkpoint's shape."""
    head(target, draft_vocab_size=64).save(tmp_path / "ckpt", target_name=target.name)
    cfg = {"draft_vocab_size": 64, key: value, "from_pretrained": str(tmp_path / "ckpt")}
    expected = rf"drafter\.{key}: .* holds {re.escape(held)};"
    with pytest.raises(ConfigError, match=expected):
        drafters.for_recipe(Eagle3Config(**cfg), target, {"input_ids": [[1]], "loss_mask": [[1]]})


def test_default_layers_are_low_middle_high():
    assert default_layers(30) == [1, 14, 26]  # vLLM's aux layers 2, 15, 27 (their inputs)
    assert default_layers(32) == [1, 15, 28]
    assert default_layers(2) == [0, 1]


@torch.no_grad()
def test_initial_head_reads_out_like_the_targets_logit_lens():
    """At initialisation step 0 is the target's LM head on its final norm of the highest fused
    layer (at the draft tokens), whatever that layer's scale; the fused features have unit
    RMS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small, tokenizer = tiny_models.tiny_llama()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**small.config.to_dict(), "num_hidden_layers": 4}))
    model.model.embed_tokens.weight.mul_(500.0)  # a large residual stream
    model.model.norm.weight.uniform_(0.5, 3.0)
    target = FrozenTarget(model.eval(), tokenizer, name="four")
    cfg = Eagle3Config(draft_vocab_size=64, target_layers=[0, 1, 2])
    drafter = drafters.build(target, cfg, counts(target))
    ids = torch.tensor([tokenizer("Tell me about the sea and the sky.")["input_ids"]])
    out, feats = features(target, drafter, ids)
    h = out.hidden_states[2][0]  # not the last layer: before the final norm
    assert h.pow(2).mean().sqrt() > 5
    want = model.lm_head(model.model.norm(h))[:, drafter.draft_ids]
    got = drafter.module.eval()(ids, None, feats)[0, 0]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    fused = drafter.module.fuse([f[0, 1:] for f in feats])
    assert fused.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.5)


@torch.no_grad()
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_feature_noise_is_relative_gaussian_and_only_while_training(target, monkeypatch, noise):
    """``feature_noise`` adds noise of that many standard deviations of the fused features to
    what the first decoder layer reads, fresh each forward, while training only: decoding and
    evaluation see the features as they are."""
    cfg = {"draft_vocab_size": 64, "ttt_steps": 2, "feature_noise": noise}
    drafter = head(target, **cfg)
    drafter.prepare_training(Eagle3Config(**cfg), target)  # training's options, as the loop does
    model = drafter.module
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    _, feats = features(target, drafter, ids)
    seen = []
    first = model.layers[0].qkv
    monkeypatch.setattr(
        model.layers[0], "qkv", lambda x, *rest: seen.append(x.clone()) or first(x, *rest)
    )
    for scale in (1.0, 30.0):  # the noise follows the features' scale, whatever it is
        scaled = [scale * f for f in feats]
        fused = model.fuse(scaled)
        reads = []
        for mode in (model.eval, model.train, model.train):
            mode()
            seen.clear()
            model(ids, None, scaled)
            reads.append(seen[0])  # step 0's input of the first layer
        clean, noisy, again = reads
        assert torch.equal(clean, fused)
        if noise == 0:
            assert torch.equal(noisy, fused) and torch.equal(again, fused)
            continue
        drawn = (noisy - fused).flatten()
        assert float(drawn.std() / fused.std()) == pytest.approx(noise, rel=0.1)
        assert abs(float(drawn.mean())) < 0.1 * float(drawn.std())
        assert abs(float(torch.corrcoef(torch.stack([drawn, fused.flatten()]))[0, 1])) < 0.1
        assert not torch.equal(noisy, again)  # drawn anew each forward


def test_unrolled_steps_are_limited_to_seven():
    from specdec.config import load_recipe
    from specdec.errors import ConfigError

    assert load_recipe(None, ["drafter.type=eagle3", "drafter.ttt_steps=7"]).drafter.ttt_steps == 7
    with pytest.raises(ConfigError, match=r"drafter.ttt_steps=8: expected <= 7, got 8"):
        load_recipe(None, ["drafter.type=eagle3", "drafter.ttt_steps=8"])


def test_recomputed_attention_keeps_no_weights_and_gives_the_same_gradients(target):
    """``recompute_attention``: no unrolled step keeps its attention weights ``[B, heads, T,
    T + s]`` for the backward (the kept computation does), and every gradient is the kept
    computation's, padding included."""
    cfg = {"draft_vocab_size": 64, "ttt_steps": 3}
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # a padded row, as training pads (on the right)
    weigh = torch.randn(3, 2, 12, 64, generator=torch.Generator().manual_seed(4))
    T = ids.shape[1]
    grads, weights_kept = [], []
    for recompute in (False, True):
        drafter = head(target, **cfg)
        drafter.prepare_training(Eagle3Config(**cfg, recompute_attention=recompute), target)
        model = drafter.module.train()
        assert model.cfg["head_dim"] < T  # no other saved tensor is [..., T, >= T]
        _, feats = features(target, drafter, ids)
        saved, hooks = [], torch.autograd.graph.saved_tensors_hooks
        with hooks(lambda x, keep=saved.append: keep(x) or x, lambda x: x):
            logits = model(ids, mask, feats)
        weights_kept.append(
            [x.shape for x in saved if x.is_floating_point() and x.dim() == 4
             and x.shape[-2] == T and x.shape[-1] >= T]
        )  # fmt: skip
        (logits * weigh).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert weights_kept[0], "the kept computation keeps the attention weights"
    assert not weights_kept[1], f"kept with recompute_attention: {weights_kept[1]}"
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_left_padded_row_trains_as_the_row_alone(target):
    """A row padded on the left (a collator that pads there) gives the unpadded row's logits at
    its tokens, whatever the padding's features, and finite gradients: a padded position that
    may attend to nothing would be all -inf in step 0, NaN in its later steps and in every
    weight's gradient."""
    drafter = head(target, draft_vocab_size=64, ttt_steps=3)
    model = drafter.module.train()
    ids = torch.randint(0, target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    _, feats = features(target, drafter, ids)
    alone = model(ids, torch.ones_like(ids), feats).detach()
    pad = 4
    padded_ids = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), torch.ones_like(ids)], dim=1)
    junk = torch.Generator().manual_seed(6)
    padded_feats = [
        torch.cat([torch.randn(1, pad, f.shape[-1], generator=junk), f], 1) for f in feats
    ]
    logits = model(padded_ids, mask, padded_feats)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, :, pad:], alone, atol=1e-5, rtol=1e-4)
    weigh = torch.randn(alone.shape, generator=junk)
    (logits[:, :, pad:] * weigh).sum().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.isfinite(p.grad).all(), name
