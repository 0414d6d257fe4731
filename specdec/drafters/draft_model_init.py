"""The draft model's architecture from the target's: which of its layers to copy, its config
(the target's, with the draft's depth and sizes), the copy itself and the reduced LM head."""

from __future__ import annotations

import logging

import torch

from specdec.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)


def chosen_layers(target, cfg) -> list[int]:
    n, total = cfg.num_layers, target.num_layers
    if cfg.init_layers:
        if len(cfg.init_layers) != n:
            raise ConfigError(
                f"drafter.init_layers: expected drafter.num_layers ({n}) entries, "
                f"got {len(cfg.init_layers)}"
            )
        try:  # one at a time: a layer may be chosen twice
            return [target.resolve_layers([i])[0] for i in cfg.init_layers]
        except ModelError as err:
            raise ConfigError(f"drafter.init_layers: {err}") from None
    if n == 1:
        return [0]
    return [round(i * (total - 1) / (n - 1)) for i in range(n)]


def draft_config(target, cfg, layers: list[int]):
    """A copy of the target's (text) config with the draft's depth, sizes and per-layer lists."""
    text = target.config.get_text_config()
    values = text.to_dict()
    overrides = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
    }
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    if cfg.init_from_target and values["hidden_size"] != text.hidden_size:
        raise ConfigError(
            f"drafter.hidden_size: {cfg.hidden_size} differs from the target's "
            f"{text.hidden_size}, so its embeddings, norm and head cannot be copied; "
            "set drafter.init_from_target: false or drop drafter.hidden_size"
        )
    # the head dimension follows hidden / heads unless the model fixes it on its own
    head_dim = values.get("head_dim")
    if head_dim is not None and head_dim == text.hidden_size // text.num_attention_heads:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    for key, value in text.to_dict().items():
        if "layer" in key and isinstance(value, list) and len(value) == text.num_hidden_layers:
            values[key] = [value[i] for i in layers]  # layer_types, mlp_layer_types, ...
    if isinstance(values.get("layer_types"), list) and "max_window_layers" in values:
        full = [t == "full_attention" for t in values["layer_types"]] + [False]
        values["max_window_layers"] = full.index(False)
    values["num_hidden_layers"] = len(layers)
    values.pop("_name_or_path", None)
    return type(text).from_dict(values)


def layers_match(config, target, cfg) -> bool:
    """Whether the draft's decoder layers have the target's shapes (only then are they copied)."""
    text = target.config.get_text_config()
    keys = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    if all(getattr(config, k, None) == getattr(text, k, None) for k in keys):
        return True
    if cfg.init_layers:
        raise ConfigError(
            "drafter.init_layers: the drafter's layer sizes (intermediate_size or heads) differ "
            "from the target's, so its layers cannot be copied; drop drafter.init_layers"
        )
    logger.info(
        "drafter layers differ in shape from the target's: only embeddings, norm and "
        "head are copied"
    )
    return False


@torch.no_grad()
def copy_from_target(model, target, layers: list[int], copy_layers: bool) -> None:
    src, dst = target.model.get_decoder(), model.get_decoder()
    if not all(hasattr(m, a) for m in (src, dst) for a in ("layers", "norm")):
        raise ConfigError(
            f"drafter.init_from_target: {type(src).__name__} has no `layers` and `norm` to copy "
            "from; set drafter.init_from_target: false"
        )
    model.get_input_embeddings().load_state_dict(target.model.get_input_embeddings().state_dict())
    dst.norm.load_state_dict(src.norm.state_dict())
    head = model.get_output_embeddings()
    head.load_state_dict(target.model.get_output_embeddings().state_dict())
    if copy_layers:
        for mine, theirs in zip(dst.layers, layers, strict=True):
            mine.load_state_dict(src.layers[theirs].state_dict())


@torch.no_grad()
def reduce_head(model, vocab_map: torch.Tensor) -> None:
    """Replace the LM head by its rows at ``vocab_map`` (untied from the input embeddings)."""
    head = model.get_output_embeddings()
    reduced = torch.nn.Linear(head.in_features, len(vocab_map), bias=head.bias is not None)
    reduced.to(head.weight.device, head.weight.dtype)
    reduced.weight.copy_(head.weight[vocab_map])
    if head.bias is not None:
        reduced.bias.copy_(head.bias[vocab_map])
    model.set_output_embeddings(reduced)
