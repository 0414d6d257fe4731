"""Export in vLLM's ``speculators`` format (``Eagle3Speculator`` heads): ``config.json`` with
``speculators_model_type``, ``transformer_layer_config`` and the ``speculators_config`` block,
and ``model.safetensors``. See :mod:`specdec.export.layout` for the verification."""

from __future__ import annotations

import os
from pathlib import Path

from specdec.export.layout import export_layout

LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def expected_keys(config: dict) -> set[str]:
    """The weights a ``speculators`` EAGLE-3 checkpoint of this config holds (no embedding:
    the verifier's is used)."""
    layer = config["transformer_layer_config"]
    return _keys(layer, [f"layers.{i}." for i in range(layer["num_hidden_layers"])])


def _keys(layer: dict, prefixes: list[str]) -> set[str]:
    keys = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    per_layer = LAYER_KEYS + (BIAS_KEYS if layer["attention_bias"] else ())
    for i, prefix in enumerate(prefixes):
        keys |= {prefix + k for k in per_layer}
        if i == 0:
            keys.add(prefix + "hidden_norm.weight")
    return keys


def export_speculators(
    checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target
) -> Path:
    return export_layout("speculators", checkpoint_dir, out_dir, target, expected_keys)
