"""The draft_model drafter's training face and checkpoints on tiny targets: building from the
target (copied layers, per-layer config lists), the reduced output vocabulary, exact decoding
with it, save/load round trips, atomic saves and plain-transformers compatibility."""

import json

import pytest
import teachers
import tiny_models
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters.draft_model import (
    CHECKPOINT_FILE,
    VOCAB_MAP_FILE,
    DraftModelConfig,
    DraftModelDrafter,
    build_draft_model,
    load_draft_model,
)
from specdec.errors import ConfigError, ModelError
from specdec.target import FrozenTarget

D = 64  # reduced vocabulary size used below


@pytest.fixture
def target(tiny_model):
    return FrozenTarget(*tiny_model, name="tiny")


@pytest.fixture
def llama(tiny_llama):
    return FrozenTarget(*tiny_llama, name="tiny-llama")


def token_counts(target) -> torch.Tensor:
    """[V] counts of the tiny corpus's tokens, as the trainer would count assistant tokens."""
    ids = torch.cat(
        [target.tokenizer(t, return_tensors="pt").input_ids[0] for t in tiny_models.CORPUS]
    )
    return torch.bincount(ids, minlength=target.vocab_size)


def layer(model, i):
    return model.get_decoder().layers[i].state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_build_copies_the_chosen_target_layers(target):
    drafter = build_draft_model(target, DraftModelConfig(num_layers=2, init_layers=[-1, 0]))
    model = drafter.model
    assert type(model) is type(target.model) and model.config.num_hidden_layers == 2
    assert same(layer(model, 0), layer(target.model, 1))
    assert same(layer(model, 1), layer(target.model, 0))
    assert torch.equal(
        model.get_input_embeddings().weight, target.model.get_input_embeddings().weight
    )
    assert torch.equal(model.lm_head.weight, target.model.lm_head.weight)
    assert same(model.get_decoder().norm.state_dict(), target.model.get_decoder().norm.state_dict())
    assert drafter.vocab_map is None and drafter.tokenizer is target.tokenizer
    assert not any(p.requires_grad for p in target.model.parameters())
    trainable = [p for p in drafter.module.parameters() if p.requires_grad]
    assert len(trainable) == len(list(model.parameters()))
    ids = torch.randint(0, target.vocab_size, (2, 5))
    teacher = drafter.teacher(target(ids).logits, torch.ones_like(ids))
    # one step; row t is the target's distribution after token t, trained where t + 1 counts
    want = torch.log_softmax(target(ids).logits, -1)
    torch.testing.assert_close(teachers.grid(teacher, 0)[0][:, :4], want[:, :4])
    assert teacher.mask[0].tolist() == [[True] * 4 + [False]] * 2


def test_build_spreads_layers_or_starts_from_random(llama):
    spread = build_draft_model(llama, DraftModelConfig(num_layers=2))
    assert same(layer(spread.model, 0), layer(llama.model, 0))
    assert same(layer(spread.model, 1), layer(llama.model, 1))
    one = build_draft_model(llama, DraftModelConfig(num_layers=1))
    assert same(layer(one.model, 0), layer(llama.model, 0))
    fresh = build_draft_model(llama, DraftModelConfig(num_layers=1, init_from_target=False))
    assert not torch.equal(fresh.model.lm_head.weight, llama.model.lm_head.weight)
    ids = torch.randint(0, llama.vocab_size, (2, 5))
    assert fresh.module(ids, torch.ones_like(ids))[0].shape == (2, 5, llama.vocab_size)


def test_changed_sizes(llama):
    with pytest.raises(ConfigError, match=r"drafter\.hidden_size: 16 differs .* 32"):
        build_draft_model(llama, DraftModelConfig(num_layers=1, hidden_size=16))
    cfg = DraftModelConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, init_from_target=False
    )
    small = build_draft_model(llama, cfg)
    assert small.model.config.head_dim == 8
    assert small.module(torch.tensor([[1, 2, 3]]))[0].shape == (1, 3, llama.vocab_size)
    narrow = build_draft_model(llama, DraftModelConfig(num_layers=1, intermediate_size=16))
    assert torch.equal(narrow.model.lm_head.weight, llama.model.lm_head.weight)
    with pytest.raises(ConfigError, match=r"drafter\.init_layers"):
        build_draft_model(
            llama, DraftModelConfig(num_layers=1, intermediate_size=16, init_layers=[0])
        )
    with pytest.raises(ConfigError, match=r"drafter\.init_layers: hidden layer 5 out of range"):
        build_draft_model(llama, DraftModelConfig(num_layers=1, init_layers=[5]))


def test_per_layer_config_lists_follow_the_chosen_layers():
    tokenizer = tiny_models.tiny_qwen2_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
        max_window_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    target = FrozenTarget(Qwen2ForCausalLM(config), tokenizer)
    assert target.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    two = build_draft_model(
        target, DraftModelConfig(num_layers=2, init_layers=[0, -1])
    ).model.config
    assert two.layer_types == ["full_attention", "sliding_attention"] and two.max_window_layers == 1
    one = build_draft_model(target, DraftModelConfig(num_layers=1, init_layers=[2])).model.config
    assert one.layer_types == ["sliding_attention"] and one.max_window_layers == 0


def test_reduced_vocabulary(target):
    counts = token_counts(target)
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1, draft_vocab_size=D), counts)
    vocab_map = drafter.vocab_map
    assert vocab_map.shape == (D,) and torch.equal(vocab_map, vocab_map.sort().values)
    added = target.tokenizer.added_tokens_decoder  # chat markers, EOS, padding
    specials = {i for i, token in added.items() if token.special} | {target.tokenizer.eos_token_id}
    assert specials <= set(vocab_map.tolist())
    # every kept ordinary token is at least as frequent as every dropped one
    kept = torch.zeros(target.vocab_size, dtype=torch.bool)
    kept[vocab_map] = True
    kept_plain = kept.clone()
    kept_plain[list(specials)] = False
    assert counts[kept_plain].min() >= counts[~kept].max()
    head = drafter.model.lm_head
    assert head.weight.shape == (D, target.hidden_size)
    assert torch.equal(head.weight, target.model.lm_head.weight[vocab_map])
    assert head.weight.data_ptr() != drafter.model.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, target.vocab_size, (2, 6))
    assert drafter.module(ids, torch.ones_like(ids)).shape == (1, 2, 6, D)
    full = target(ids).logits
    teacher = drafter.teacher(full, torch.ones_like(ids))
    # the target's full-vocabulary log-probabilities read at the draft's tokens
    log_p, tokens = (x[:, :5] for x in teachers.grid(teacher, 0))  # row 5: no next token
    torch.testing.assert_close(log_p, torch.log_softmax(full, -1)[:, :5, vocab_map])
    best = full[:, :5].argmax(-1)
    inside = torch.isin(best, vocab_map)
    assert torch.equal(tokens >= 0, inside)
    assert torch.equal(vocab_map[tokens[inside]], best[inside])

    with pytest.raises(ValueError, match="token_counts"):
        build_draft_model(target, DraftModelConfig(num_layers=1, draft_vocab_size=D))
    with pytest.raises(ConfigError, match=r"drafter\.draft_vocab_size"):
        build_draft_model(target, DraftModelConfig(num_layers=1, draft_vocab_size=2), counts)
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=target.vocab_size)
    assert build_draft_model(target, cfg).vocab_map is None


def test_reduced_vocabulary_decoding_is_exact(target):
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=D)
    drafter = build_draft_model(target, cfg, token_counts(target))
    session = ModelSession(target.model)
    prompt = target.tokenizer("The quick brown fox").input_ids
    plain = generate(session, prompt, max_new_tokens=24).tokens
    drafted = generate(session, prompt, drafter=drafter, k=3, max_new_tokens=24)
    assert drafted.tokens == plain and sum(drafted.drafted) > 0
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    sampled = generate(
        session, prompt, drafter=drafter, params=params, generator=gen, max_new_tokens=16
    )
    assert all(0 <= t < target.vocab_size for t in sampled.tokens)
    # q over the target's vocabulary is the draft's own distribution at its tokens' ids
    drafter.configure("transformers")
    drafter.begin(prompt)
    proposal = drafter.propose(prompt, 3, params, torch.Generator().manual_seed(1))
    ids = drafter.vocab_map
    for i in range(len(proposal)):
        context = torch.tensor([prompt + proposal.tokens[:i].tolist()])
        with torch.no_grad():
            own = torch.softmax(drafter.model(context).logits[0, -1].float(), -1)  # [D]
        expected = torch.zeros(target.vocab_size)
        expected[ids] = own
        torch.testing.assert_close(proposal.probs[i], expected, atol=1e-5, rtol=1e-4)
        assert int(proposal.tokens[i]) in ids.tolist()


@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
def test_save_load_round_trip(target, tmp_path, reduced):
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=D if reduced else None)
    drafter = build_draft_model(target, cfg, token_counts(target))
    with torch.no_grad():  # as if trained: the copy of the target must not be what is compared
        drafter.model.get_decoder().layers[0].mlp.up_proj.weight.mul_(1.5)
    path = drafter.save(tmp_path / "ckpt", target_name="tiny", extra={"step": 7})
    meta = json.loads((path / CHECKPOINT_FILE).read_text())
    assert meta["type"] == "draft_model" and meta["target"] == "tiny" and meta["step"] == 7
    assert meta["num_layers"] == 1 and meta["draft_vocab_size"] == (D if reduced else None)
    assert (path / VOCAB_MAP_FILE).is_file() == reduced
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]

    loaded = DraftModelDrafter.from_checkpoint(str(path), target)
    ids = torch.randint(0, target.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded.module(ids)[0], drafter.module(ids)[0])
    if reduced:
        assert torch.equal(loaded.vocab_map, drafter.vocab_map)
        with pytest.raises(ModelError, match="specdec's decoder"):
            load_draft_model(str(path), target.tokenizer, target.vocab_size)
    else:
        assert loaded.vocab_map is None
    with pytest.raises(ValueError, match="overwrite"):
        drafter.save(tmp_path / "other", target_name="tiny", extra={"type": "x"})


def test_save_is_atomic(llama, tmp_path, monkeypatch):
    drafter = build_draft_model(llama, DraftModelConfig(num_layers=1))
    path = drafter.save(tmp_path / "ckpt", target_name="tiny", extra={"step": 1})

    def broken(self, directory, **kwargs):
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(type(drafter.model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        drafter.save(tmp_path / "new", target_name="tiny")
    with pytest.raises(OSError, match="disk full"):
        drafter.save(path, target_name="tiny", extra={"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no half checkpoint, no temp dirs
    assert json.loads((path / CHECKPOINT_FILE).read_text())["step"] == 1
    monkeypatch.undo()
    drafter.save(path, target_name="tiny", extra={"step": 3})  # replaces the old one
    assert json.loads((path / CHECKPOINT_FILE).read_text())["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_full_vocabulary_checkpoint_is_a_plain_assistant_model(target, tmp_path):
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    path = drafter.save(tmp_path / "ckpt", target_name="tiny")
    draft = AutoModelForCausalLM.from_pretrained(path)
    assert type(draft) is type(target.model)
    ids = target.tokenizer("Hello! How are you", return_tensors="pt").input_ids
    kwargs = {
        "max_new_tokens": 12,
        "do_sample": False,
        "pad_token_id": target.tokenizer.pad_token_id,
    }
    plain = target.model.generate(ids, **kwargs)
    assisted = target.model.generate(ids, assistant_model=draft, **kwargs)
    assert torch.equal(assisted, plain)


def test_from_checkpoint_refuses_other_checkpoints(llama, tmp_path):
    (tmp_path / CHECKPOINT_FILE).write_text(json.dumps({"type": "medusa"}))
    with pytest.raises(ModelError, match="'medusa' checkpoint"):
        DraftModelDrafter.from_checkpoint(str(tmp_path), llama)
    with pytest.raises(ModelError, match="not a specdec checkpoint"):
        DraftModelDrafter.from_checkpoint(str(tmp_path / "nothing"), llama)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_confidence_stops_the_draft_early_and_keeps_a_prefix(target, temperature):
    """A confident-draft threshold only shortens the proposal: the tokens and the q they were
    sampled from are a prefix of what the same draft proposes without it."""
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=D)
    drafter = build_draft_model(target, cfg, token_counts(target))
    params = SamplingParams(temperature=temperature)
    sequence = target.tokenizer("The quick brown fox").input_ids
    lengths = []
    for confidence in (0.0, 0.5, 0.999):
        drafter.confidence = confidence
        drafter.begin(sequence)
        gen = torch.Generator().manual_seed(3)
        proposal = drafter.propose(sequence, 6, params, gen)
        if confidence == 0.0:
            full = proposal
        n = len(proposal.tokens)
        lengths.append(n)
        assert n >= 1 and torch.equal(proposal.tokens, full.tokens[:n])
        if temperature:  # it stops right after the first token that takes the chain below
            torch.testing.assert_close(proposal.probs, full.probs[:n])
            chain = torch.cumprod(full.probs[torch.arange(6), full.tokens], 0)
            below = (chain < confidence).nonzero()
            assert n == (int(below[0]) + 1 if len(below) else 6)
    assert lengths[0] == 6 and lengths[2] < 6 and lengths == sorted(lengths, reverse=True)


def test_greedy_decoding_with_a_confident_draft_is_exact(target):
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=D)
    drafter = build_draft_model(target, cfg, token_counts(target))
    drafter.confidence = 0.3
    session = ModelSession(target.model)
    prompt = target.tokenizer("The quick brown fox").input_ids
    plain = generate(session, prompt, max_new_tokens=24).tokens
    drafted = generate(session, prompt, drafter=drafter, k=4, max_new_tokens=24)
    assert drafted.tokens == plain
    rounds = drafted.drafted[:-1]  # the last round may have no room left to draft
    assert min(rounds) >= 1 and max(rounds) <= 4 and min(rounds) < 4


def test_a_sequence_already_in_the_drafts_cache_is_drafted_after(target):
    """The next round's sequence may be wholly in the draft's cache (every draft token it fed
    kept): the draft re-feeds the last token instead of extending by nothing."""
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    prompt = target.tokenizer("The quick brown fox").input_ids
    drafter.begin(prompt)
    first = drafter.propose(prompt, 3, SamplingParams()).tokens.tolist()
    sequence = prompt + first[:2]  # the draft fed first[0] and first[1] to draft first[2]
    drafter.commit(2)
    again = drafter.propose(sequence, 3, SamplingParams()).tokens.tolist()
    fresh = build_draft_model(target, DraftModelConfig(num_layers=1))
    fresh.begin(sequence)
    assert again == fresh.propose(sequence, 3, SamplingParams()).tokens.tolist()
    assert again[0] == first[2]
