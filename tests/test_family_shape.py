"""The drafter family shape: families are reached only through the registry, hidden layers are
numbered the same everywhere, and moving the draft model onto the shape changed no output."""

import json
import re
from pathlib import Path

import pytest
import tiny_models
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import drafters
from specdec.decoding.compact import CompactSession, target_session
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.errors import ConfigError
from specdec.target import FrozenTarget

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"


def test_no_family_name_outside_the_drafters_package():
    """Scoring, training, export, the CLI, the decoder and the benchmarks name no family: they
    go through the registry and the drafter interface."""
    names = "|".join(re.escape(n) for n in drafters.REGISTRY)
    classes = "|".join(cls.__name__ for cls in drafters.REGISTRY.values())
    pattern = re.compile(
        rf"""(["'])({names})\1|drafters\.({names})\b|\b({classes}|build_draft_model)\b"""
    )
    offenders = []
    for path in [*ROOT.glob("specdec/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("eval/*.py"),
                 *ROOT.glob("train/*.py")]:  # fmt: skip
        if "drafters" in path.relative_to(ROOT).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_family_has_the_same_faces():
    for name, cls in drafters.REGISTRY.items():
        assert cls.name == name
        assert cls.config_class().type == name
        for face in ("build", "from_checkpoint", "begin", "propose", "commit", "configure"):
            assert callable(getattr(cls, face)), (name, face)
        if drafters.is_trainable(name):
            for face in ("module", "teacher", "loss_masks", "step_weights", "save"):
                assert hasattr(cls, face), (name, face)


def _four_layers():
    model, tokenizer = tiny_models.tiny_llama()
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 4})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.mark.parametrize("layer", [-1, -3, 0, 2])
def test_hidden_layers_are_numbered_alike_everywhere(layer):
    """Layer i is transformers' hidden_states[i + 1]; -1 is the last layer (after the final
    norm), -3 the second: in the target's forward and in both decoding sessions."""
    model, tokenizer = _four_layers()
    ids = torch.tensor([tokenizer("The quick brown fox jumps")["input_ids"]])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    want = states[layer % 4 + 1][0]
    target = FrozenTarget(model, tokenizer, name="four")
    got = target.forward(ids, hidden_layers=[layer]).hidden_states[layer % 4][0]
    torch.testing.assert_close(got, want)
    for session in (ModelSession(model, [layer]), CompactSession(model, torch.float32, [layer])):
        session.extend(ids[0].tolist())
        torch.testing.assert_close(session.hidden[layer], want, atol=1e-5, rtol=1e-4)


def test_draft_model_decoding_is_unchanged_by_the_family_shape():
    """tests/data/draft_model_decoding.json was decoded from tests/data/tiny-draft-model by the
    code before the family shape (greedy with a confidence stop, and top-k/top-p sampling,
    through both target forwards); the same checkpoint decodes to the same tokens and rounds."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    drafter = drafters.load(DATA / "tiny-draft-model", target)
    golden = json.loads((DATA / "draft_model_decoding.json").read_text())
    prompts = ["Tell me about the sea.", "def add(a, b):", "Count to five."]
    cases = [("greedy", SamplingParams(), 0.2), ("sampled", SamplingParams(0.8, 20, 0.9), 0.0)]
    for name, params, confidence in cases:
        for forward in ("transformers", "auto"):
            session = target_session(target.model, forward)
            drafter.configure("auto", confidence)
            for i, text in enumerate(prompts):
                prompt = target.tokenizer(text)["input_ids"]
                out = generate(
                    session, prompt, drafter=drafter, k=3, max_new_tokens=40, params=params,
                    generator=torch.Generator().manual_seed(i),
                )  # fmt: skip
                want = golden[f"{name}/{forward}/{i}"]
                assert out.tokens == want["tokens"]
                assert (out.accepted, out.drafted) == (want["accepted"], want["drafted"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["transformers", "compact"])
def test_sessions_verify_a_tree_and_keep_its_path(family, kind):
    """A tree [a; b, c] (b and c both follow a) in one forward, with explicit positions and a
    tree mask, gives each node the logits its own chain gives; keeping the path a, c leaves
    the cache of the chain prefix + a + c."""
    build = tiny_models.tiny_llama if family == "llama" else tiny_models.tiny_qwen2
    model, tokenizer = build()

    def session():
        if kind == "compact":
            return CompactSession(model, torch.float32)
        return ModelSession(model)

    prefix = tokenizer("The quick brown fox")["input_ids"]
    a, b, c, d = 40, 41, 42, 43
    p = len(prefix)
    tree = session()
    tree.extend(prefix)
    mask = torch.ones(3, p + 3, dtype=torch.bool)
    mask[1, p + 2] = mask[2, p + 1] = False  # siblings do not see each other
    mask[0, p + 1 :] = False
    got = tree.extend([a, b, c], positions=torch.tensor([p, p + 1, p + 1]), mask=mask)
    for path, rows in (([a, b], [0, 1]), ([a, c], [0, 2])):
        chain = session()
        chain.extend(prefix)
        want = chain.extend(path)
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-4)
    tree.keep([*range(p), p, p + 2])
    assert tree.ids == [*prefix, a, c] and tree.length == p + 2
    chain = session()
    chain.extend([*prefix, a, c])
    torch.testing.assert_close(tree.extend([d]), chain.extend([d]), atol=1e-5, rtol=1e-4)
    tree.keep(range(p))  # a chain rollback is keep of a prefix
    assert tree.ids == prefix and tree.length == p


ROW_READERS = {  # families whose trainable module skips the rows a loss does not read
    "eagle3": dict(num_layers=2, ttt_steps=3, draft_vocab_size=48),  # 2 layers: see below
    "medusa": dict(num_heads=3, lora_rank=0),
    "mtp": dict(num_modules=2, draft_vocab_size=48, init_from_target=False),
    "draft_model": dict(num_layers=2, draft_vocab_size=48),
}


@pytest.mark.parametrize("family", list(ROW_READERS))
def test_rows_read_alone_give_the_full_forwards_logits_and_gradients(family):
    """Given the rows a loss reads (``at``), a family's training forward gives those rows'
    logits alone, in ``x[at]``'s order, equal to its forward over every row there, and a loss
    over them the same gradients. The reference is the forward without ``at``. EAGLE-3 has two
    layers here: on its first step the first layer must still run at every row, since the
    second layer's keys read all of them."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    torch.manual_seed(0)
    config = drafters.drafter_class(family).config_class(type=family, **ROW_READERS[family])
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, config, counts)
    model, wanted = drafter.module, drafter.required_target_layers
    with torch.no_grad():  # away from the start (zero blocks, identity copies)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=generator)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # the second row is padded
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[0, 4:10], at[1, [2, 5, 6]] = True, True  # an answer's span; scattered positions
    out = target.forward(ids, attention, hidden_layers=wanted)
    feats = [out.hidden_states[i] for i in wanted]
    weights = torch.randn(3, int(at.sum()), generator=generator)

    def run(rows):
        model.zero_grad()
        logits = model(ids, attention, feats, at=rows)  # [S, B, T, D] or [S, N, D]
        picked = logits[:, at] if rows is None else logits
        (picked.log_softmax(-1)[..., 0] * weights[: len(picked)]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    full, full_grads = run(None)
    sparse, sparse_grads = run(at)
    assert sparse.shape == (full.shape[0], int(at.sum()), full.shape[-1])
    torch.testing.assert_close(sparse, full[:, at], atol=1e-5, rtol=1e-4)
    assert set(sparse_grads) == set(full_grads) and full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_per_row_agreements_of_a_micro_batch():
    """The loss's per-row counts, from which the per-source metrics are summed: each row's
    positions trained by the first draft step, and those where the draft's argmax is the
    target's, counted here from the full forward and the target's own logits (EAGLE-3's
    first step at row t predicts token t + 2, which the target's logits at t + 1 give). The
    target's read-out is zero (its argmax: token 0 everywhere) and the draft's favours token 0
    where its normed state sums above zero, so about half the positions agree."""
    from specdec.config.schema import LossConfig
    from specdec.training.step import drafter_loss

    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    torch.manual_seed(0)
    config = drafters.drafter_class("eagle3").config_class(draft_vocab_size=None, ttt_steps=2)
    drafter = drafters.build(target, config)
    model, layers = drafter.module, drafter.required_target_layers
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.lm_head.weight[0] = 100.0
        head = target.model.lm_head
        target.model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        target.model.lm_head.weight.zero_()
    ids = torch.randint(0, target.vocab_size, (3, 12), generator=torch.Generator().manual_seed(5))
    attention = torch.ones_like(ids)
    attention[2, 8:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 3:], loss_mask[1, 6:9], loss_mask[2, 4:8] = 1, 1, 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    counts = drafter.loss_masks(loss_mask).sum(dim=(1, 2)).float()
    _, _, (agree, count) = drafter_loss(drafter, model, target, batch, LossConfig(), counts)

    with torch.no_grad():
        out = target.forward(ids, attention, hidden_layers=layers)
        draft = model(ids, attention, [out.hidden_states[i] for i in layers])[0]  # [B, T, V]
    trained = loss_mask[:, 2:].bool()  # row t trains where token t + 2 is an answer's
    hits = draft[:, :-2].argmax(-1) == out.logits[:, 1:-1].argmax(-1)
    assert count.tolist() == trained.sum(dim=1).tolist() == [9, 3, 4]
    assert agree.tolist() == (hits & trained).sum(dim=1).tolist()
    assert 0 < sum(agree.tolist()) < sum(count.tolist())  # neither all nor none agree


def _hard_ce_micro_batch(target, drafter):
    """The training step on two rows of 14 random tokens (answers from token 3 and over tokens
    5-11) with ``loss.name: ce``: its loss and metrics, the answer mask, and the full
    forwards to check them by hand: the target's, and the drafter's ``[S, B, T, D]``."""
    from specdec.config.schema import LossConfig
    from specdec.training.step import drafter_loss

    model, layers = drafter.module, drafter.required_target_layers
    ids = torch.randint(0, target.vocab_size, (2, 14), generator=torch.Generator().manual_seed(4))
    attention = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 3:], loss_mask[1, 5:12] = 1, 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    steps = drafter.loss_masks(loss_mask).sum(dim=(1, 2)).float()
    loss, metrics, _ = drafter_loss(drafter, model, target, batch, LossConfig(name="ce"), steps)
    with torch.no_grad():
        out = target.forward(ids, attention, hidden_layers=layers)
        draft = model(ids, attention, [out.hidden_states[i] for i in layers])
    return loss.detach(), metrics, loss_mask, out, draft


def test_hard_ce_of_a_micro_batch_is_on_the_targets_own_argmax():
    """``loss.name: ce`` trains on the target's full-vocabulary argmax: EAGLE-3's first step at
    row t against the target's logits at t + 1, computed here from the full forwards, and no
    loss where that token lies outside the draft vocabulary (the draft can never emit it)."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    torch.manual_seed(0)
    counts = torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(3))
    size = target.vocab_size // 2
    config = drafters.drafter_class("eagle3").config_class(draft_vocab_size=size, ttt_steps=2)
    drafter = drafters.build(target, config, counts)
    _, metrics, loss_mask, out, draft = _hard_ce_micro_batch(target, drafter)
    draft = draft[0]  # step 0, [B, T, D]
    draft_ids = drafter.draft_ids.tolist()
    total, count, outside, mass = 0.0, 0, 0, 0.0
    for b in range(2):
        for t in range(12):
            if not loss_mask[b, t + 2]:
                continue
            count += 1
            mass += float(torch.softmax(out.logits[b, t + 1].double(), -1)[draft_ids].sum())
            best = int(out.logits[b, t + 1].argmax())
            if best not in draft_ids:
                outside += 1
                continue
            total -= float(torch.log_softmax(draft[b, t].double(), -1)[draft_ids.index(best)])
    assert 0 < outside < count  # some of the target's tokens fall outside the draft's
    assert float(metrics["train/loss/ce"]) == pytest.approx(total / count, rel=1e-4)
    # the target's probability on the draft's tokens (what the draft can reach at all)
    assert 0.3 < mass / count < 0.9
    assert float(metrics["train/teacher_mass"]) == pytest.approx(mass / count, rel=1e-5)


def test_unrolled_steps_are_weighted_by_decay_to_the_power_of_the_step():
    """EAGLE-3's loss is ``sum_s decay**s * CE_s``, CE_s over step s's positions (row t
    predicting token t + 2 + s from the target's logits at t + 1 + s), each step divided by
    its own count; computed here from the full forwards, step by step."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    torch.manual_seed(0)
    config = drafters.drafter_class("eagle3").config_class(
        draft_vocab_size=None, ttt_steps=3, step_weight_decay=0.5
    )
    drafter = drafters.build(target, config, None)
    with torch.no_grad():  # off the identity start, where every step would read out alike
        for p in drafter.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss, _, loss_mask, out, draft = _hard_ce_micro_batch(target, drafter)  # draft [3, B, T, V]
    want = 0.0
    for s, weight in enumerate((1.0, 0.5, 0.25)):
        total, count = 0.0, 0
        for b in range(2):
            for t in range(14 - 2 - s):
                if loss_mask[b, t + 2 + s]:
                    best = int(out.logits[b, t + 1 + s].argmax())
                    total -= float(torch.log_softmax(draft[s, b, t].double(), -1)[best])
                    count += 1
        want += weight * total / count
    assert float(loss) == pytest.approx(want, rel=1e-4)


HEADS = {  # family: (its saved config, its loss-weight key, a shape key, the saved value)
    "eagle3": (dict(draft_vocab_size=48), "step_weight_decay", "num_layers", 1),
    "medusa": (dict(num_heads=3, lora_rank=0), "head_weight_decay", "num_heads", 3),
    "mtp": (dict(num_modules=2, init_from_target=False), "step_weight_decay", "num_modules", 2),
}


@pytest.mark.parametrize("family", list(HEADS))
def test_a_drafter_from_pretrained_trains_with_the_recipes_weights_in_its_own_shape(
    family, tmp_path
):
    """``drafter.from_pretrained``: the loss weights are the recipe's (``decay ** s``, written
    out here), not the saved run's; a recipe asking for another shape is refused, naming the
    key, rather than trained in the checkpoint's shape."""
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    config = drafters.drafter_class(family).config_class
    saved, decay, key, held = HEADS[family]
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, config(type=family, **saved, **{decay: 0.9}), counts)
    path = str(drafter.save(tmp_path / "ckpt", target_name=target.name))
    loaded = drafters.for_recipe(
        config(type=family, **saved, **{decay: 0.5}, from_pretrained=path), target, None
    )
    assert loaded.step_weights().tolist() == pytest.approx([1.0, 0.5, 0.25][: loaded.steps])
    other = {**saved, key: held + 1}
    with pytest.raises(ConfigError, match=rf"drafter\.{key}: {held + 1} in the recipe.* {held};"):
        drafters.for_recipe(config(type=family, **other, from_pretrained=path), target, None)
