"""MTP modules in the layouts that hold them outside specdec, both ways.

- ``speculators`` (vLLM's speculators format, ``MTPDraftModel``): one module under
  ``mtp_layers.0.``: ``hidden_layernorm``, ``token_layernorm``, ``input_proj`` (over the normed
  embedding *then* the normed hidden state), the decoder layer under Llama names, and
  ``final_layernorm``; no embedding and no LM head (the verifier's are used). ``config.json``
  has ``speculators_model_type: mtp``, the verifier's ``transformer_layer_config`` (its
  ``vocab_size`` and layer count), ``num_nextn_predict_layers: 1`` and the
  ``speculators_config`` block. The format holds one module over the full vocabulary.
- A model's own MTP layers, read to start from them (``drafter.init_from``): MiMo's
  ``model.mtp_layers.{k}.`` (the same names; hidden state first, as specdec's ``eh_proj``),
  Qwen3-Next's ``mtp.`` (``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``, ``fc`` over the
  embedding first, ``layers.0.``, ``norm``), and the speculators layout above.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.errors import ModelError

#: specdec's names inside one module -> the MiMo / speculators names
MODULE_NAMES = {
    "hnorm": "hidden_layernorm",
    "enorm": "token_layernorm",
    "eh_proj": "input_proj",
    "norm": "final_layernorm",
    "layer.input_norm": "input_layernorm",
    "layer.q_proj": "self_attn.q_proj",
    "layer.k_proj": "self_attn.k_proj",
    "layer.v_proj": "self_attn.v_proj",
    "layer.o_proj": "self_attn.o_proj",
    "layer.post_norm": "post_attention_layernorm",
    "layer.gate_proj": "mlp.gate_proj",
    "layer.up_proj": "mlp.up_proj",
    "layer.down_proj": "mlp.down_proj",
}
#: the same for Qwen3-Next's ``mtp.`` layout
QWEN3_NEXT_NAMES = MODULE_NAMES | {
    "hnorm": "pre_fc_norm_hidden",
    "enorm": "pre_fc_norm_embedding",
    "eh_proj": "fc",
    "norm": "norm",
    **{k: "layers.0." + v for k, v in MODULE_NAMES.items() if k.startswith("layer.")},
}
#: how checkpoints name their MTP layers: (key prefix of module k, names, embedding first)
NATIVE = {
    "mimo": ("model.mtp_layers.{k}.", MODULE_NAMES, False),
    "speculators": ("mtp_layers.{k}.", MODULE_NAMES, True),
    "qwen3_next": ("mtp.", QWEN3_NEXT_NAMES, True),
}
SPECULATORS_PREFIX = "mtp_layers.0."


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """``eh_proj`` over ``[a; b]`` as a projection over ``[b; a]`` (its own inverse)."""
    half = weight.shape[1] // 2
    return torch.cat([weight[:, half:], weight[:, :half]], dim=1)


def _external(name: str, names: dict[str, str]) -> str:
    module, leaf = name.rsplit(".", 1)
    return f"{names[module]}.{leaf}"


def to_layout(module_state: dict, prefix: str, names: dict, emb_first: bool) -> dict:
    """One module's weights (specdec's names) under a layout's names."""
    out = {}
    for name, tensor in module_state.items():
        if name == "eh_proj.weight" and emb_first:
            tensor = swap_halves(tensor)
        out[prefix + _external(name, names)] = tensor.detach().cpu().contiguous()
    return out


def from_layout(state: dict, prefix: str, names: dict, emb_first: bool) -> dict:
    """One module's weights back under specdec's names; keys under ``prefix`` that no specdec
    weight takes are kept under their own name, for a strict load to name them."""
    back = {}
    for module in names:
        for leaf in ("weight", "bias"):
            back[prefix + _external(f"{module}.{leaf}", names)] = f"{module}.{leaf}"
    out = {}
    for key, tensor in state.items():
        if not key.startswith(prefix):
            continue
        name = back.get(key, key[len(prefix) :])
        if name == "eh_proj.weight" and emb_first:
            tensor = swap_halves(tensor)
        out[name] = tensor
    return out


# ------------------------------------------------------------------------------ speculators


def export(drafter, fmt: str, target) -> tuple[dict, dict]:
    """``(config.json, weights)`` of one full-vocabulary module in the speculators layout.

    Raises:
        ModelError: more than one module, or a reduced draft vocabulary.
    """
    if drafter.steps != 1 or drafter.draft_ids is not None:
        raise ModelError(
            f"the {fmt} layout holds one MTP module over the full vocabulary "
            "(drafter.num_modules: 1, drafter.draft_vocab_size: null); this checkpoint has "
            f"{drafter.steps} module(s) and a draft vocabulary of "
            f"{drafter.vocab_size if drafter.draft_ids is None else len(drafter.draft_ids)}"
        )
    cfg = drafter.model.cfg
    module = drafter.model.depths[0].state_dict()
    state = to_layout(module, SPECULATORS_PREFIX, MODULE_NAMES, emb_first=True)
    text = target.config.get_text_config()
    layer = {
        "model_type": getattr(text, "model_type", "llama"),
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["kv_heads"],
        "head_dim": cfg["head_dim"],
        "num_hidden_layers": target.num_layers,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "attention_bias": cfg["attention_bias"],
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_parameters": cfg["rope_parameters"],
        "rope_theta": cfg["rope_parameters"].get("rope_theta"),
        "vocab_size": drafter.vocab_size,
        "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
    }
    architectures = list(getattr(target.config, "architectures", None) or [])
    config = {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "num_nextn_predict_layers": 1,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "mtp",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 1}],
            "verifier": {"name_or_path": target.name, "architectures": architectures},
        },
        "dtype": str(drafter.model.dtype).replace("torch.", ""),
    }
    return config, state


def expected_keys(fmt: str, config: dict) -> set[str]:
    """The weights speculators' ``MTPDraftModel`` reads (biases where the layer has them)."""
    layer = config["transformer_layer_config"]
    keys = {SPECULATORS_PREFIX + _external(f"{m}.weight", MODULE_NAMES) for m in MODULE_NAMES}
    if layer["attention_bias"]:
        keys |= {f"{SPECULATORS_PREFIX}self_attn.{p}_proj.bias" for p in "qkv"}
    return keys


def check_layer_config(config: dict, head_cfg: dict) -> None:
    """An export's layer sizes against the modules specdec builds for the target.

    Raises:
        ModelError: they differ (an export for another verifier).
    """
    layer = config["transformer_layer_config"]
    pairs = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_attention_heads": "heads",
        "num_key_value_heads": "kv_heads",
        "head_dim": "head_dim",
    }
    wrong = [k for k, ours in pairs.items() if layer.get(k) != head_cfg[ours]]
    if wrong:
        raise ModelError(f"mtp export: its {', '.join(wrong)} do not fit the target")


# ------------------------------------------------------------------- a model's own MTP layers


def read_native(directory: str | Path) -> tuple[str, list[dict]]:
    """``(layout name, [module k's weights under specdec's names])`` of the MTP layers a
    safetensors checkpoint directory holds (one file or an index of shards); only those
    tensors are read.

    Raises:
        ModelError: no safetensors weights there, or no MTP layers in them.
    """
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            where = json.loads(index.read_text())["weight_map"]
        elif (directory / "model.safetensors").is_file():
            with safe_open(directory / "model.safetensors", framework="pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ModelError(f"{directory}: no model.safetensors or its index to read MTP from")
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{directory}: unreadable weights ({err})") from None
    for layout, (prefix, names, emb_first) in NATIVE.items():
        modules = []
        while len(modules) < 64:
            here = prefix.format(k=len(modules))
            keys = [key for key in where if key.startswith(here)]
            if not keys:
                break
            state = {}
            for key in keys:
                with safe_open(directory / where[key], framework="pt") as f:
                    state[key] = f.get_tensor(key)
            modules.append(from_layout(state, here, names, emb_first))
            if "{k}" not in prefix:
                break
        if modules:
            return layout, modules
    raise ModelError(
        f"{directory}: no MTP layers in its weights (looked for keys "
        f"{', '.join(p.format(k=0) for p, _, _ in NATIVE.values())}...)"
    )
