"""Export in SGLang's layout (``LlamaForCausalLMEagle3``): a Llama ``config.json`` with
``draft_vocab_size`` and the target layers under ``eagle_config``, the head's layer named
``midlayer``, and ``model.safetensors`` without embedding weights (SGLang uses the target's).
See :mod:`specdec.export.layout` for the verification."""

from __future__ import annotations

import os
from pathlib import Path

from specdec.export.layout import export_layout
from specdec.export.speculators import _keys


def expected_keys(config: dict) -> set[str]:
    return _keys(config, ["midlayer."])


def export_sglang(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target) -> Path:
    return export_layout("sglang", checkpoint_dir, out_dir, target, expected_keys)
