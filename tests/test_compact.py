"""The compact draft forward computes what transformers computes, and keeps decoding exact."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specdec.decoding import compact, kernels
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.errors import ConfigError

SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES, rope_theta=500.0))
    elif family == "qwen2":  # biases on q, k, v
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    else:  # per-head norms on q and k, head_dim not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=24))
    with torch.no_grad():  # biases and norms away from their zero/one initial values
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


LAYOUTS = ["linear", "transposed", "tuned"] + (["packed"] if kernels.packing_available() else [])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_compact_float32_matches_transformers(family, layout):
    model = _model(family)
    assert compact.supports(model)
    ref = ModelSession(model)
    fast = compact.CompactSession(model, torch.float32, capacity=8, layout=layout)  # grows twice
    assert fast.layout == layout
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    steps = [[26], [43, 38, 32], [79]]
    torch.testing.assert_close(fast.extend(prompt), ref.extend(prompt), atol=1e-5, rtol=1e-4)
    for tokens in steps:
        torch.testing.assert_close(fast.extend(tokens), ref.extend(tokens), atol=1e-5, rtol=1e-4)
    # roll back into the middle, then continue differently: the stale cache must not leak
    ref.rollback(11)
    fast.rollback(11)
    assert fast.ids == ref.ids and fast.length == 11
    torch.testing.assert_close(
        fast.extend([5, 6], last_only=True), ref.extend([5, 6], last_only=True), atol=1e-5,
        rtol=1e-4,
    )  # fmt: skip
    # a device-tensor feed is recorded lazily, as in ModelSession
    fast.extend(torch.tensor([7]))
    assert fast.ids[-3:] == [5, 6, 7]


def test_compact_float16_is_close_and_returns_float32():
    model = _model("llama")
    prompt = list(range(1, 40))
    ref = ModelSession(model).extend(prompt)
    out = compact.CompactSession(model, dtype=torch.float16).extend(prompt)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compact_follows_in_place_weight_updates(layout):
    """A session used for scoring during training sees the latest optimizer step (its reordered
    copies of the weights too: three new tokens are multiplied by them)."""
    model = _model("llama")
    fast = compact.CompactSession(model, dtype=torch.float32, layout=layout)
    before = fast.extend([1, 2, 3]).clone()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    fast.reset()
    after = fast.extend([1, 2, 3])
    torch.testing.assert_close(after, ModelSession(model).extend([1, 2, 3]), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(before, after)


def test_unsupported_architecture_keeps_the_transformers_forward():
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16)).eval()
    assert not compact.supports(gemma)
    drafter = DraftModelDrafter(gemma, target_vocab_size=97)
    assert type(drafter.session) is ModelSession
    with pytest.raises(ConfigError, match="no compact forward"):
        drafter.use_forward("float16")
    with pytest.raises(ConfigError, match="expected one of"):
        DraftModelDrafter(_model("llama"), 97, forward="int4")


@pytest.mark.parametrize("forward", ["auto", "float32", "bfloat16", "transformers"])
def test_greedy_decoding_with_a_compact_draft_is_the_targets_output(forward):
    """Whatever the draft's dtype, greedy speculative output is the target's greedy output."""
    target = _model("llama")
    draft = _model("llama")  # different random weights would accept nothing: share some
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    drafter = DraftModelDrafter(draft, target_vocab_size=97, forward=forward)
    expected = {"transformers": ModelSession, "auto": compact.CompactSession}
    assert isinstance(drafter.session, expected.get(forward, compact.CompactSession))
    prompt = [5, 17, 33, 2, 41]
    plain = target.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    out = generate(
        ModelSession(target), prompt, drafter=drafter, k=3, max_new_tokens=24,
        params=SamplingParams(), eos_token_ids=(),
    )  # fmt: skip
    assert out.tokens == plain


@pytest.mark.skipif(not kernels.packing_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 40])
def test_packed_layout_multiplies_by_the_reordered_weight_from_three_rows(rows):
    """The reordered copy is what is multiplied from three rows on, the plain weight below."""
    torch.manual_seed(0)
    x, weight = torch.randn(rows, 24), torch.randn(40, 24)
    zeros = kernels.reorder(torch.zeros_like(weight))
    out = kernels.TunedLinear(compact.LAYOUTS["packed"])(x, weight, None, zeros)
    assert out.abs().max() == 0 if rows >= 3 else out.abs().max() > 0


def test_layout_choices():
    model = _model("llama")
    with pytest.raises(ValueError, match="compact layout 'fast': expected one of"):
        compact.CompactSession(model, torch.float32, layout="fast")
    with pytest.raises(ValueError, match="'packed': needs float32 on a CPU"):
        compact.CompactSession(model, torch.float16, layout="packed")
    assert compact.CompactSession(model, torch.float16).layout == "tuned"  # on a CPU
    assert compact.CompactSession(model, torch.float32).layout == "tuned"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_session_is_compact_in_the_targets_dtype_with_its_hidden_layers(family):
    model = _model(family)
    layers = (0, 1)  # 1 is the last: after the final norm, as transformers returns it
    fast = compact.target_session(model, "auto", hidden_layers=layers)
    assert isinstance(fast, compact.CompactSession) and fast.dtype == torch.float32
    assert fast.layout == "tuned"
    ref = compact.target_session(model, "transformers", hidden_layers=layers)
    assert type(ref) is ModelSession
    for tokens in ([3, 14, 15, 92, 65], [35], [89, 79], [12, 34, 56]):
        torch.testing.assert_close(fast.extend(tokens), ref.extend(tokens), atol=1e-5, rtol=1e-4)
        assert fast.hidden.keys() == ref.hidden.keys() == set(layers)
        for i in layers:
            torch.testing.assert_close(fast.hidden[i], ref.hidden[i], atol=1e-5, rtol=1e-4)


def test_target_session_choices():
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16)).eval()
    assert type(compact.target_session(gemma, "auto")) is ModelSession
    with pytest.raises(ConfigError, match="target forward 'compact'.*no compact forward"):
        compact.target_session(gemma, "compact")
    with pytest.raises(ConfigError, match="target forward: expected one of"):
        compact.target_session(_model("llama"), "fast")


def test_greedy_decoding_with_a_compact_target_is_the_targets_output():
    """Plain and speculative decoding through the compact target reproduce generate()."""
    target, draft = _model("llama"), _model("llama")
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    prompt = [5, 17, 33, 2, 41]
    plain = target.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    session = compact.target_session(target)
    assert generate(session, prompt, max_new_tokens=24).tokens == plain
    drafter = DraftModelDrafter(draft, target_vocab_size=97, confidence=0.2)
    assert generate(session, prompt, drafter=drafter, k=4, max_new_tokens=24).tokens == plain
