"""Exports of EAGLE-3 heads in the speculators and SGLang layouts: the format's key set, the
config fields engines read, a reload with equal logits, and refusals."""

import json

import pytest
import tiny_models
import torch
from safetensors.torch import load_file

from specdec import drafters
from specdec.cli import main
from specdec.drafters.eagle3 import Eagle3Config
from specdec.errors import ModelError
from specdec.export import export
from specdec.target import FrozenTarget


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint(request, tmp_path):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    target = FrozenTarget(*build(), name=f"tiny-{request.param}")
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, Eagle3Config(draft_vocab_size=80, ttt_steps=2), counts)
    with torch.no_grad():
        for p in drafter.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return target, drafter, drafter.save(tmp_path / "ckpt", target_name=target.name)


def test_speculators_layout(checkpoint, tmp_path):
    target, drafter, path = checkpoint
    out = export("speculators", path, tmp_path / "spec", target)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 80
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == target.vocab_size  # the verifier's, not the draft's
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == target.hidden_size
    assert config["speculators_config"]["verifier"]["name_or_path"] == target.name
    # engines count the layer whose input they read: one more than specdec's output index
    assert config["eagle_aux_hidden_state_layer_ids"] == [
        i + 1 for i in drafter.required_target_layers
    ]
    state = load_file(out / "model.safetensors")
    assert not any("embed" in k for k in state)
    assert state["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.hidden_size
    assert torch.equal(state["layers.0.input_layernorm.weight"],
                       drafter.model.layers[0].embed_norm.weight)  # fmt: skip
    assert torch.equal(state["lm_head.weight"], drafter.model.lm_head.weight)
    ids = state["d2t"] + torch.arange(80)
    assert torch.equal(ids, drafter.draft_ids) and bool(state["t2d"][ids].all())
    assert int(state["t2d"].sum()) == 80
    bias = "layers.0.self_attn.q_proj.bias" in state
    assert bias == drafter.model.cfg["attention_bias"] == layer["attention_bias"]


def test_sglang_layout(checkpoint, tmp_path):
    target, drafter, path = checkpoint
    out = export("sglang", path, tmp_path / "sg", target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 80 and config["vocab_size"] == target.vocab_size
    assert config["tie_word_embeddings"] is False  # else SGLang reads the embedding as head
    state = load_file(out / "model.safetensors")
    assert "midlayer.hidden_norm.weight" in state and "fc.weight" in state
    assert not any(k.startswith("layers.") or "embed" in k for k in state)


def test_a_misnamed_weight_is_refused(checkpoint, tmp_path, monkeypatch):
    from specdec.drafters import eagle3_layouts

    target, _, path = checkpoint
    real = eagle3_layouts.engine_state

    def extra(*args):
        return real(*args) | {"embed_tokens.weight": torch.zeros(1)}

    monkeypatch.setattr(eagle3_layouts, "engine_state", extra)
    with pytest.raises(ModelError, match="embed_tokens.weight.*key set"):
        export("speculators", path, tmp_path / "spec", target)
    assert not (tmp_path / "spec").exists()


def test_reload_with_other_logits_is_refused(checkpoint, tmp_path, monkeypatch):
    from specdec.drafters import eagle3_layouts

    target, _, path = checkpoint
    real = eagle3_layouts.engine_state

    def scaled(*args):
        state = real(*args)
        state["norm.weight"] = state["norm.weight"] * 1.01
        return state

    monkeypatch.setattr(eagle3_layouts, "engine_state", scaled)
    with pytest.raises(ModelError, match="logits differ"):
        export("sglang", path, tmp_path / "sg", target)


def test_layouts_refuse_other_families_and_formats(tmp_path):
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    from specdec.drafters.draft_model import DraftModelConfig

    draft = drafters.build(target, DraftModelConfig(num_layers=1))
    path = draft.save(tmp_path / "draft", target_name="tiny")
    with pytest.raises(ModelError, match="'draft_model' drafter has no 'speculators' layout"):
        export("speculators", path, tmp_path / "x", target)
    head = drafters.build(target, Eagle3Config())
    hpath = head.save(tmp_path / "head", target_name="tiny")
    with pytest.raises(ModelError, match="not a standalone causal LM"):
        export("hf", hpath, tmp_path / "y", target)
    two = drafters.build(target, Eagle3Config(num_layers=2))
    tpath = two.save(tmp_path / "two", target_name="tiny")
    with pytest.raises(ModelError, match="one-layer heads"):
        export("sglang", tpath, tmp_path / "z", target)
    export("speculators", tpath, tmp_path / "z", target)  # several layers: speculators holds them


def test_export_command_refuses_to_replace_a_directory(checkpoint, tmp_path, capsys):
    target, _, path = checkpoint
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code = main(["export", "--checkpoint", str(path), "--format", "sglang", "--out", str(out)])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"specdec: error: --out {out}: exists and is not empty; pass --force to replace it"
    )
    assert (out / "notes.txt").read_text() == "keep me"
