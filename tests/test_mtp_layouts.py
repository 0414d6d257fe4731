"""MTP modules outside specdec: the speculators layout (key set, config, the input projection's
halves swapped, reload), and starting from MTP layers a checkpoint already has (MiMo's,
Qwen3-Next's, a speculators export), with the names written here by hand from those formats."""

import json
from pathlib import Path

import pytest
import tiny_models
import torch
from safetensors.torch import load_file, save_file
from test_cli_errors import error_line
from test_mtp import modules

from specdec import drafters
from specdec.config.validation import Invalid
from specdec.drafters import mtp
from specdec.drafters.eagle3_model import head_config
from specdec.drafters.mtp import MTPConfig
from specdec.errors import ModelError
from specdec.export import export
from specdec.target import FrozenTarget

#: specdec's weight -> the name MiMo and speculators give it inside one MTP layer
MIMO = {
    "hnorm.weight": "hidden_layernorm.weight",
    "enorm.weight": "token_layernorm.weight",
    "eh_proj.weight": "input_proj.weight",
    "layer.input_norm.weight": "input_layernorm.weight",
    "layer.q_proj.weight": "self_attn.q_proj.weight",
    "layer.k_proj.weight": "self_attn.k_proj.weight",
    "layer.v_proj.weight": "self_attn.v_proj.weight",
    "layer.o_proj.weight": "self_attn.o_proj.weight",
    "layer.post_norm.weight": "post_attention_layernorm.weight",
    "layer.gate_proj.weight": "mlp.gate_proj.weight",
    "layer.up_proj.weight": "mlp.up_proj.weight",
    "layer.down_proj.weight": "mlp.down_proj.weight",
    "norm.weight": "final_layernorm.weight",
}
BIASES = {f"layer.{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
#: Qwen3-Next's names of the same weights under ``mtp.``
QWEN3_NEXT = {
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "eh_proj.weight": "fc.weight",
    "norm.weight": "norm.weight",
    **{k: "layers.0." + v for k, v in MIMO.items() if k.startswith("layer.")},
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    return FrozenTarget(*build(), name=f"tiny-{request.param}")


def logits_of(drafter, target, seed=2):
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    h = torch.randn(2, 9, target.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        return drafter.module(ids, None, [h])


def emb_first(weight):
    """eh_proj over [hidden; embedding] as a projection over [embedding; hidden]."""
    h = weight.shape[1] // 2
    return torch.cat([weight[:, h:], weight[:, :h]], dim=1)


def test_speculators_layout_of_one_module(target, tmp_path):
    drafter = modules(target, num_modules=1)
    path = drafter.save(tmp_path / "ckpt", target_name=target.name)
    out = export("speculators", path, tmp_path / "spec", target)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp"
    assert config["architectures"] == ["MTPDraftModel"]
    assert config["num_nextn_predict_layers"] == 1
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == target.vocab_size
    assert layer["num_hidden_layers"] == target.num_layers  # the verifier's, MTP reads its last
    assert layer["hidden_size"] == target.hidden_size
    assert config["speculators_config"]["algorithm"] == "mtp"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 1
    assert config["speculators_config"]["verifier"]["name_or_path"] == target.name
    state = load_file(out / "model.safetensors")
    assert set(state) == {"mtp_layers.0." + v for v in MIMO.values()}  # no embedding, no head
    ours = drafter.module.depths[0].state_dict()
    for name, theirs in MIMO.items():
        want = emb_first(ours[name]) if name == "eh_proj.weight" else ours[name]
        assert torch.equal(state["mtp_layers.0." + theirs], want), name
    # back into training: a recipe can start from the export
    again = drafters.build(target, MTPConfig(num_modules=1, init_from=str(out)))
    torch.testing.assert_close(logits_of(again, target), logits_of(drafter, target))


def test_speculators_layout_refuses_what_it_cannot_hold(target, tmp_path):
    two = modules(target, num_modules=2).save(tmp_path / "two", target_name=target.name)
    with pytest.raises(ModelError, match="one MTP module over the full vocabulary.*2 module"):
        export("speculators", two, tmp_path / "a", target)
    small = modules(target, num_modules=1, draft_vocab_size=50)
    path = small.save(tmp_path / "small", target_name=target.name)
    with pytest.raises(ModelError, match="draft vocabulary of 50"):
        export("speculators", path, tmp_path / "b", target)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ModelError, match="'mtp' drafter has no 'sglang' layout"):
        export("sglang", two, tmp_path / "c", target)


def source_modules(target, num_modules: int, bias: bool):
    """Perturbed MTP modules standing in for a model's own (with attention biases, as MiMo's
    Qwen2 layers have, where ``bias``)."""
    cfg = head_config(target, 1, 1, target.vocab_size, num_modules)
    cfg |= {"num_modules": num_modules, "own_head": False, "attention_bias": bias}
    model = mtp.new_model(target, cfg)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return mtp.MTPDrafter(model, target.resolve_layers([-1])[0], None, target.vocab_size)


def checkpoint_with(target, tmp_path, extra: dict):
    """The target's own checkpoint directory with ``extra`` weights added to its file."""
    where = tmp_path / "model"
    target.model.save_pretrained(where)
    state = load_file(where / "model.safetensors") | extra
    save_file(state, where / "model.safetensors", metadata={"format": "pt"})
    return where


@pytest.mark.parametrize("bias", [False, True])
def test_init_from_mimo_layers(target, tmp_path, bias):
    source = source_modules(target, 2, bias)
    names = MIMO | (BIASES if bias else {})
    extra = {
        f"model.mtp_layers.{k}.{names[n]}": t.clone()
        for k, depth in enumerate(source.module.depths)
        for n, t in depth.state_dict().items()
    }
    where = checkpoint_with(target, tmp_path, extra)
    drafter = drafters.build(target, MTPConfig(num_modules=2, init_from=str(where)))
    assert drafter.module.cfg["attention_bias"] == bias
    torch.testing.assert_close(logits_of(drafter, target), logits_of(source, target))
    with pytest.raises(ModelError, match="holds 2 MTP module.*mimo layout.*num_modules is 3"):
        drafters.build(target, MTPConfig(num_modules=3, init_from=str(where)))


def test_init_from_qwen3_next_layers_and_the_target_itself(target, tmp_path):
    from transformers import AutoModelForCausalLM

    source = source_modules(target, 1, False)
    state = source.module.depths[0].state_dict()
    extra = {
        "mtp." + QWEN3_NEXT[n]: (emb_first(t) if n == "eh_proj.weight" else t).clone()
        for n, t in state.items()
    }
    where = checkpoint_with(target, tmp_path, extra)
    drafter = drafters.build(target, MTPConfig(num_modules=1, init_from=str(where)))
    torch.testing.assert_close(logits_of(drafter, target), logits_of(source, target))
    # `target`: the directory the target was loaded from
    loaded = FrozenTarget(AutoModelForCausalLM.from_pretrained(where), target.tokenizer, name="t")
    own = drafters.build(loaded, MTPConfig(num_modules=1, init_from="target"))
    torch.testing.assert_close(logits_of(own, loaded), logits_of(source, target))
    with pytest.raises(ModelError, match="was not loaded from a local directory"):
        drafters.build(target, MTPConfig(num_modules=1, init_from="target"))


def test_init_from_refuses_layers_it_cannot_hold(target, tmp_path):
    source = source_modules(target, 1, False).module.depths[0].state_dict()
    extra = {"mtp." + QWEN3_NEXT[n]: t.clone() for n, t in source.items()}
    extra["mtp.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # Qwen3's, not specdec's
    where = checkpoint_with(target, tmp_path / "a", extra)
    with pytest.raises(ModelError, match="MTP module 0 does not fit.*q_norm"):
        drafters.build(target, MTPConfig(num_modules=1, init_from=str(where)))
    plain = checkpoint_with(target, tmp_path / "b", {})
    with pytest.raises(ModelError, match="no MTP layers in its weights"):
        drafters.build(target, MTPConfig(num_modules=1, init_from=str(plain)))
    with pytest.raises(Invalid, match="drafter.init_from: .*nowhere: no such directory"):
        MTPConfig(init_from=str(tmp_path / "nowhere")).check()


def test_init_from_a_directory_that_does_not_exist(capsys, tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "debug" / "tiny_mtp.yaml"
    nowhere = tmp_path / "nowhere"
    err = error_line(capsys, ["check", str(recipe), "--set", f"drafter.init_from={nowhere}"])
    assert err == f"specdec: error: --set drafter.init_from={nowhere}: {nowhere}: no such directory"
