"""The EAGLE-3 head in the layouts serving engines load: names of its weights and its config.

- ``speculators`` (vLLM's ``speculators`` format, ``Eagle3Speculator``): weights ``fc``,
  ``layers.{i}.*`` with Llama decoder-layer names (the first layer's ``input_layernorm``
  normalises the embedding, ``hidden_norm`` the hidden state), ``norm``, ``lm_head``, ``d2t``,
  ``t2d``; ``config.json`` with ``speculators_model_type``, ``transformer_layer_config`` (whose
  ``vocab_size`` is the verifier's), ``draft_vocab_size`` and the ``speculators_config`` block
  naming the proposal method and the verifier.
- ``sglang`` (SGLang's ``LlamaForCausalLMEagle3``): the same weights with the first layer named
  ``midlayer``; a Llama ``config.json`` with ``draft_vocab_size`` and the target layers.

Neither carries embedding weights: both engines take the target's. Engines name a target layer
by the decoder layer whose *input* it is, one more than specdec's numbering by output.
"""

from __future__ import annotations

import torch

#: specdec's names inside a layer -> the engines' (Llama decoder-layer names)
LAYER_NAMES = {
    "embed_norm": "input_layernorm",
    "input_norm": "input_layernorm",
    "hidden_norm": "hidden_norm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "post_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
FORMATS = ("speculators", "sglang")
#: a layer's weights in the engines' names (biases where the layer has them)
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


def expected_keys(fmt: str, config: dict) -> set[str]:
    """The weights an engine reads from an export with this ``config.json`` (no embedding:
    engines take the target's)."""
    if fmt == "sglang":
        layer, prefixes = config, ["midlayer."]
    else:
        layer = config["transformer_layer_config"]
        prefixes = [f"layers.{i}." for i in range(layer["num_hidden_layers"])]
    keys = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    per_layer = LAYER_KEYS + (BIAS_KEYS if layer["attention_bias"] else ())
    for i, prefix in enumerate(prefixes):
        keys |= {prefix + k for k in per_layer}
        if i == 0:
            keys.add(prefix + "hidden_norm.weight")
    return keys


def layer_prefix(fmt: str, index: int) -> str:
    return "midlayer." if fmt == "sglang" else f"layers.{index}."


def engine_name(name: str, fmt: str) -> str:
    """The engine's name of one of the head's weights (``layers.0.q_proj.weight`` ->
    ``layers.0.self_attn.q_proj.weight`` or ``midlayer.self_attn.q_proj.weight``)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return name
    module, leaf = ".".join(parts[2:-1]), parts[-1]
    return f"{layer_prefix(fmt, int(parts[1]))}{LAYER_NAMES[module]}.{leaf}"


def engine_state(model, fmt: str, draft_ids, vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's weights under the engine's names, with the vocabulary maps."""
    from specdec.drafters import vocabulary

    state = {
        engine_name(name, fmt): tensor.detach().cpu().contiguous()
        for name, tensor in model.state_dict().items()
    }
    ids = torch.arange(vocab_size) if draft_ids is None else draft_ids.cpu()
    state["d2t"] = vocabulary.d2t(ids)
    state["t2d"] = vocabulary.t2d(ids, vocab_size)
    return state


def specdec_state(state: dict[str, torch.Tensor], fmt: str, model) -> dict[str, torch.Tensor]:
    """The inverse of :func:`engine_state` for a head ``model`` of the export's config (the
    vocabulary maps left out; names it does not know are kept, for a strict load to refuse)."""
    names = {engine_name(name, fmt): name for name in model.state_dict()}
    return {names.get(k, k): v for k, v in state.items() if k not in ("d2t", "t2d")}


def engine_config(drafter, fmt: str, target) -> dict:
    """``config.json`` of the export."""
    cfg = drafter.model.cfg
    text = target.config.get_text_config()
    aux = [i + 1 for i in drafter.required_target_layers]  # engines count layer inputs
    layer = {
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["kv_heads"],
        "head_dim": cfg["head_dim"],
        "num_hidden_layers": cfg["num_layers"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "attention_bias": cfg["attention_bias"],
        "mlp_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_parameters": cfg["rope_parameters"],
        "rope_theta": cfg["rope_parameters"].get("rope_theta"),
        "vocab_size": drafter.vocab_size,
        "tie_word_embeddings": False,
    }
    draft_vocab = cfg["draft_vocab_size"]
    if fmt == "sglang":
        return layer | {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": cfg["target_hidden_size"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": drafter.name,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": aux,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": drafter.name,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg["steps"],
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": target.name,
                "architectures": list(getattr(text, "architectures", None) or [])
                or list(getattr(target.config, "architectures", None) or []),
            },
        },
        "dtype": str(drafter.model.fc.weight.dtype).replace("torch.", ""),
    }


def head_config(config: dict, fmt: str, steps: int) -> tuple[dict, list[int]]:
    """specdec's head config and target layers back from an export's ``config.json``."""
    if fmt == "sglang":
        layer, aux = config, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    else:
        layer, aux = config["transformer_layer_config"], config["eagle_aux_hidden_state_layer_ids"]
    cfg = {
        "hidden_size": layer["hidden_size"],
        "target_hidden_size": config["target_hidden_size"],
        "num_features": len(aux),
        "heads": layer["num_attention_heads"],
        "kv_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "intermediate_size": layer["intermediate_size"],
        "num_layers": layer["num_hidden_layers"],
        "rms_norm_eps": layer["rms_norm_eps"],
        "attention_bias": layer["attention_bias"],
        "draft_vocab_size": config["draft_vocab_size"],
        "steps": steps,
        "max_position_embeddings": layer["max_position_embeddings"],
        "rope_parameters": layer["rope_parameters"],
    }
    return cfg, [i - 1 for i in aux]
