"""Medusa heads in the layouts serving engines load.

- ``medusa`` (FasterDecoding/Medusa, TGI, TensorRT-LLM): ``config.json`` with
  ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``;
  ``medusa_lm_head.safetensors`` with, for head h, ``h.l.linear.weight`` / ``.bias`` of block
  l and ``h.L.weight``, the head's own full-vocabulary LM head (the target's, copied into each
  head where the heads share it). A reduced draft vocabulary has no place in it.
- ``vllm_medusa`` (vLLM's ``MedusaModel``): ``blocks.h.layers.l.weight`` / ``.bias``, one LM
  head shared by the heads (``original_lm_head``) as ``lm_heads.0.weight``, and for a reduced
  vocabulary ``truncated_vocab_size`` with ``token_map`` (the draft's target ids).

Medusa-2 heads read their adapted backbone, so both layouts carry it beside them in
``base_model/`` (:meth:`MedusaDrafter.export_extras`).
"""

from __future__ import annotations

import torch

from specdec.errors import ModelError


def _target_head(target) -> torch.Tensor:
    return target.model.get_output_embeddings().weight.detach().cpu()


def export(drafter, fmt: str, target) -> tuple[dict, dict]:
    """``(config.json, weights)`` of ``drafter``'s heads in layout ``fmt``."""
    cfg, model = drafter.model.cfg, drafter.model
    heads, layers = cfg["num_heads"], cfg["num_layers"]
    head = (
        model.lm_head.weight.detach().cpu() if model.lm_head is not None else _target_head(target)
    )
    blocks = {}
    for h in range(heads):
        for i in range(layers):
            linear = model.blocks[h][i].linear
            blocks[h, i] = (linear.weight.detach().cpu(), linear.bias.detach().cpu())
    if fmt == "medusa":
        if drafter.draft_ids is not None:
            raise ModelError(
                "the medusa layout holds full-vocabulary heads (drafter.draft_vocab_size: null); "
                "use vllm_medusa for a reduced vocabulary"
            )
        state = {}
        for (h, i), (w, b) in blocks.items():
            state[f"{h}.{i}.linear.weight"], state[f"{h}.{i}.linear.bias"] = w, b
        state |= {f"{h}.{layers}.weight": head.clone() for h in range(heads)}
        config = {
            "medusa_num_heads": heads,
            "medusa_num_layers": layers,
            "base_model_name_or_path": target.name,
            "hidden_size": cfg["hidden_size"],
            "vocab_size": drafter.vocab_size,
        }
        return config, {k: v.contiguous() for k, v in state.items()}
    state = {}
    for (h, i), (w, b) in blocks.items():
        state[f"blocks.{h}.layers.{i}.weight"], state[f"blocks.{h}.layers.{i}.bias"] = w, b
    state["lm_heads.0.weight"] = head.clone()
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg["hidden_size"],
        "vocab_size": drafter.vocab_size,
        "num_heads": heads,
        "num_hidden_layers": layers,
        "medusa_fc_bias": True,
        "original_lm_head": True,
        "truncated_vocab_size": cfg["draft_vocab_size"],
    }
    if drafter.draft_ids is not None:
        state["token_map"] = drafter.draft_ids.cpu().clone()
    return config, {k: v.contiguous() for k, v in state.items()}


def expected_keys(fmt: str, config: dict) -> set[str]:
    """The weights the layout's loader reads, from its ``config.json``."""
    if fmt == "medusa":
        heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
        keys = {f"{h}.{layers}.weight" for h in range(heads)}
        for h in range(heads):
            keys |= {f"{h}.{i}.linear.{p}" for i in range(layers) for p in ("weight", "bias")}
        return keys
    heads, layers = config["num_heads"], config["num_hidden_layers"]
    keys = {f"blocks.{h}.layers.{i}.{p}" for h in range(heads) for i in range(layers)
            for p in ("weight", "bias")}  # fmt: skip
    keys.add("lm_heads.0.weight")
    if config["truncated_vocab_size"] < config["vocab_size"]:
        keys.add("token_map")
    return keys


def specdec_state(fmt: str, config: dict, state: dict) -> tuple:
    """``(heads config, MedusaHeads state, draft ids or None, the LM head)`` back from a
    layout.

    Raises:
        ModelError: the medusa layout's heads do not share one LM head (specdec's heads do).
    """
    out, draft_ids = {}, None
    if fmt == "medusa":
        heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
        for h in range(heads):
            for i in range(layers):
                for p in ("weight", "bias"):
                    out[f"blocks.{h}.{i}.linear.{p}"] = state[f"{h}.{i}.linear.{p}"]
        head = state[f"0.{layers}.weight"]
        if any(not torch.equal(state[f"{h}.{layers}.weight"], head) for h in range(heads)):
            raise ModelError("medusa export: heads with LM heads of their own are not specdec's")
        size = head.shape[0]
    else:
        heads, layers = config["num_heads"], config["num_hidden_layers"]
        for h in range(heads):
            for i in range(layers):
                for p in ("weight", "bias"):
                    out[f"blocks.{h}.{i}.linear.{p}"] = state[f"blocks.{h}.layers.{i}.{p}"]
        head, size = state["lm_heads.0.weight"], config["truncated_vocab_size"]
        draft_ids = state.get("token_map")
    own = draft_ids is not None
    if own:
        out["lm_head.weight"] = head
    heads_cfg = {
        "num_heads": heads,
        "num_layers": layers,
        "hidden_size": config["hidden_size"],
        "draft_vocab_size": size,
        "own_head": own,
    }
    return heads_cfg, out, draft_ids, head
