"""Exporters: the hf format round trip and its verification, refusals, the format registry."""

import json
import subprocess
import sys

import pytest
import tiny_models
import torch
from transformers import AutoModelForCausalLM

from specdec.drafters.draft_model import DraftModelConfig, build_draft_model
from specdec.errors import ConfigError, ModelError
from specdec.export import EXPORTERS, export
from specdec.export.hf import verify_hf
from specdec.target import FrozenTarget


@pytest.fixture
def target(tiny_model):
    return FrozenTarget(*tiny_model, name="tiny")


def test_hf_export_round_trip(target, tmp_path):
    drafter = build_draft_model(target, DraftModelConfig(num_layers=1))
    ckpt = drafter.save(tmp_path / "ckpt", target_name="tiny")
    out = export("hf", ckpt, tmp_path / "export" / "hf", target)
    assert out == tmp_path / "export" / "hf" and (out / "tokenizer.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["hf"]
    assert json.loads((out / "config.json").read_text())["specdec_export"]["target"] == "tiny"
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, target.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, drafter.model(ids).logits, atol=1e-6)
    export("hf", ckpt, out, target)  # an existing export is replaced
    assert [p.name for p in out.parent.iterdir()] == ["hf"]


def test_hf_verification_catches_a_different_model(tmp_path):
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    ckpt = build_draft_model(target, DraftModelConfig(num_layers=1)).save(
        tmp_path / "ckpt", target_name="tiny"
    )
    out = export("hf", ckpt, tmp_path / "hf", target)
    other = build_draft_model(target, DraftModelConfig(num_layers=1, init_from_target=False))
    with pytest.raises(ModelError, match="logits differ"):
        verify_hf(out, other.model, target.tokenizer)
    deeper = build_draft_model(target, DraftModelConfig(num_layers=2)).model
    with pytest.raises(ModelError, match="keys differ"):
        verify_hf(out, deeper, target.tokenizer)


def test_reduced_vocabulary_is_not_exported(tmp_path):
    target = FrozenTarget(*tiny_models.tiny_llama(), name="tiny")
    counts = torch.ones(target.vocab_size)
    cfg = DraftModelConfig(num_layers=1, draft_vocab_size=48)
    ckpt = build_draft_model(target, cfg, counts).save(tmp_path / "ckpt", target_name="tiny")
    with pytest.raises(ModelError, match="needs specdec's decoder, or re-training"):
        export("hf", ckpt, tmp_path / "hf", target)
    assert not (tmp_path / "hf").exists()


def test_unknown_formats():
    assert set(EXPORTERS) == {"hf", "speculators", "sglang", "medusa", "vllm_medusa"}
    with pytest.raises(ConfigError, match="unknown export format 'hff' .*'hf'.*; available: hf"):
        export("hff", "ckpt", "out", None)


def test_export_does_not_import_accelerate():
    code = "import sys, specdec.export; print('accelerate' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
