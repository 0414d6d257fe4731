"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state.

The target's LM head reads its last hidden state h_t and predicts token t + 1; Medusa adds K
heads on the same h_t, head i predicting token t + 2 + i. Each head is ``num_layers``
residual blocks ``x + SiLU(W x + b)`` followed by an LM head. The blocks start at zero (W and
b), so every head starts as the target's own read-out; the LM head is the target's (frozen and
shared, not saved) or, with ``draft_vocab_size``, one of the drafter's own over the most
frequent tokens of the training answers, shared by the heads and started from the target's
rows. Medusa-1: the target stays frozen.

Training face: S = K steps, step s at row t predicts token t + 2 + s from the target's h_t
(``shift = 1``); the teacher is the target's distribution at row t + 1 + s (soft targets), the
loss weight of head s is ``decay ** s``.

Decoding face: the heads read the target's features of the last verified position (the
verify forward computed them): small products, no model forward (on a CPU in float16 or the
heads' own dtype, whichever is measured faster there, ``eval.draft_forward``). A chain takes
head i's token at depth i + 1, running head i only when it drafts that depth; a tree (Medusa's
static "choices", or dynamic by path probability) gives every node at depth d the children of
head d. q at depth d is head d's processed distribution whatever the tokens before it, a valid
proposal for the rejection rule: decoding stays exact.

Medusa-2 (``lora_rank`` > 0; :mod:`specdec.drafters.medusa_adapted`): the heads train jointly
with LoRA adapters on the backbone, step 0 being the adapted backbone's own next-token
distribution distilled from the original target's; proposals are then verified by the
adapted backbone, whose output it is. Medusa-1 heads from ``from_pretrained`` train on as
Medusa-2 when ``lora_rank`` > 0 (the paper's heads warm-up).

Checkpoints: ``model.safetensors`` (the blocks, and the own LM head with the ``d2t`` / ``t2d``
vocabulary maps), ``config.json``, ``drafter.json``, and for Medusa-2 ``adapter/`` (peft's
layout).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config.schema import DrafterConfig, option
from specdec.config.validation import Invalid
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import Clock
from specdec.drafters import vocabulary
from specdec.drafters.base import (
    DecodingCopy,
    Proposal,
    TrainableDrafter,
    checked_forward,
    decoding_dtype,
    draft_chain,
    vocab_shape,
)
from specdec.drafters.checkpoint import check_head_fits, read_head, write_head
from specdec.drafters.medusa_model import MedusaHeads
from specdec.drafters.tree import draft_tree
from specdec.errors import ConfigError, ModelError

#: the target layer the heads read: the last one, after the final norm (the LM head's input)
LAST = -1
#: Medusa-2 exports: the adapted backbone (adapters merged), beside the heads
BASE_MODEL_DIR = "base_model"


@dataclass
class MedusaConfig(DrafterConfig):
    type: str = option("medusa", "Drafter family (registry name).")
    num_heads: int = option(4, "Heads K: head i predicts the token i + 2 ahead.", ge=1, le=16)
    num_layers: int = option(1, "Residual blocks per head.", ge=1)
    draft_vocab_size: int | None = option(
        None, "null: the heads read out through the target's LM head (frozen, shared, not "
        "saved); a number: through an LM head of their own over that many of the most frequent "
        "target tokens of the training answers (trained, shared by the heads; Medusa-2's "
        "backbone keeps its own full-vocabulary head).", ge=1,
    )  # fmt: skip
    head_weight_decay: float = option(
        0.8, "Loss weight of head i: decay ** i (later heads are harder).", gt=0, le=1
    )
    lora_rank: int = option(
        0, "0: Medusa-1, the target frozen. > 0: Medusa-2, LoRA adapters of this rank on the "
        "backbone (peft), trained with the heads; the output is then the adapted backbone's.",
        ge=0,
    )  # fmt: skip
    lora_alpha: float = option(16.0, "Medusa-2: LoRA scaling numerator (alpha / rank).", gt=0)
    lora_target_modules: list[str] = option(
        ["q_proj", "v_proj"], "Medusa-2: the backbone's projections that get adapters."
    )
    backbone_weight: float = option(5.0, "Medusa-2: loss weight of the backbone's self-"
        "distillation, head 1's being 1 (5: the paper's heads at 0.2).", ge=0)  # fmt: skip
    adapter_lr_scale: float = option(0.25, "Medusa-2: the adapters' learning rate over "
        "train.lr, the heads' (the paper's heads run at 4x the backbone's).", gt=0)  # fmt: skip
    gradient_checkpointing: bool = option(False, "Medusa-2: recompute the backbone's layers "
        "in the backward instead of keeping activations (less memory).")  # fmt: skip

    def check(self) -> None:
        if self.lora_rank and not self.lora_target_modules:
            raise Invalid("drafter.lora_target_modules", "empty: Medusa-2 adapts some projection")
        if self.gradient_checkpointing and not (self.lora_rank or self.from_pretrained):
            raise Invalid("drafter.gradient_checkpointing", "Medusa-2 only (lora_rank > 0): "
                          "Medusa-1 runs no backward through the backbone")  # fmt: skip


class MedusaDrafter(TrainableDrafter):
    """Medusa heads as a drafter (see the module docstring).

    Args:
        model: the heads.
        target_layer: the target layer they read (resolved: the last one).
        draft_ids: ``[D]`` target ids of their outputs, or None for the full vocabulary.
        vocab_size: the target's vocabulary size (width of q).
        head_weight_decay: loss weight of head s is ``decay ** s``.
    """

    name = "medusa"
    branches = True
    config_class = MedusaConfig
    shift = 1
    #: serving layouts (format -> weights file), see :mod:`specdec.drafters.medusa_layouts`
    layouts = {"medusa": "medusa_lm_head.safetensors", "vllm_medusa": "model.safetensors"}

    def __init__(
        self,
        model: MedusaHeads,
        target_layer: int,
        draft_ids: torch.Tensor | None,
        vocab_size: int,
        head_weight_decay: float = 0.8,
        backbone=None,
        backbone_weight: float = 5.0,
    ):
        self.model = model
        self.required_target_layers = (target_layer,)
        self.draft_ids = draft_ids
        self.vocab_size = vocab_size
        self.steps = model.cfg["num_heads"]
        self.decay = head_weight_decay
        self.backbone, self.backbone_weight = None, backbone_weight
        self.adapted, self.adapter_lr_scale = None, 1.0
        if backbone is not None:
            self._adapt(backbone)
        self.confidence, self.forward, self._copy = 0.0, "auto", DecodingCopy()
        self.decoder = model
        self.clock = Clock(next(model.parameters()).device)
        self.seconds = 0.0
        self.h: torch.Tensor | None = None

    # ------------------------------------------------------------------------------ building

    @staticmethod
    def _head_config(target, cfg: MedusaConfig, draft_ids) -> dict:
        return {
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "hidden_size": target.hidden_size,
            "draft_vocab_size": target.vocab_size if draft_ids is None else len(draft_ids),
            "own_head": draft_ids is not None,
        }

    @classmethod
    def build(cls, target, cfg: MedusaConfig, token_counts=None) -> MedusaDrafter:
        """Fresh heads for ``target`` (each the target's own read-out), on its device."""
        draft_ids = vocabulary.draft_vocab(target, cfg.draft_vocab_size, token_counts)
        head = target.model.get_output_embeddings()
        model = MedusaHeads(cls._head_config(target, cfg, draft_ids), head)
        model.to(device=target.device, dtype=head.weight.dtype)
        if draft_ids is not None:
            with torch.no_grad():
                rows = head.weight.index_select(0, draft_ids.to(head.weight.device))
                model.lm_head.weight.copy_(rows)
        layer = target.resolve_layers([LAST])[0]
        backbone = None
        if cfg.lora_rank:
            from specdec.drafters.medusa_adapted import adapt

            backbone = adapt(target.model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
        return cls(
            model, layer, draft_ids, target.vocab_size, cfg.head_weight_decay, backbone,
            cfg.backbone_weight,
        )  # fmt: skip

    def param_groups(self, params: list, lr: float) -> list[dict]:
        if self.adapted is None:
            return [{"params": params}]
        return self.adapted.param_groups(params, lr * self.adapter_lr_scale)

    def _adapt(self, backbone) -> None:
        """Medusa-2: step 0 is the adapted ``backbone``'s next token, then the heads."""
        from specdec.drafters.medusa_adapted import AdaptedHeads

        self.backbone, self.adapted = backbone, AdaptedHeads(self.model, backbone)
        self.steps, self.shift = self.model.cfg["num_heads"] + 1, 0
        self.adapts_target = True

    def prepare_training(self, config: MedusaConfig, target) -> None:
        """Medusa-1 heads (``from_pretrained``) with ``lora_rank`` > 0 get adapters here; a
        loaded drafter takes the recipe's loss weights and adapter rate."""
        from specdec.drafters import medusa_adapted

        self.decay, self.backbone_weight = config.head_weight_decay, config.backbone_weight
        self.adapter_lr_scale = config.adapter_lr_scale
        if self.backbone is None and config.lora_rank:
            self._adapt(medusa_adapted.adapt(target.model, config.lora_rank, config.lora_alpha,
                                             config.lora_target_modules))  # fmt: skip
        if not config.gradient_checkpointing:
            return
        if self.backbone is None:
            raise ConfigError(
                f"drafter.gradient_checkpointing: {config.from_pretrained} holds Medusa-1 heads "
                "and drafter.lora_rank is 0: no backward runs through the backbone"
            )
        medusa_adapted.checkpoint_layers(self.backbone)

    def loaded_shape(self, config: MedusaConfig, target) -> dict[str, tuple]:
        return {
            "num_heads": (config.num_heads, self.model.cfg["num_heads"]),
            "num_layers": (config.num_layers, self.model.cfg["num_layers"]),
            "draft_vocab_size": vocab_shape(config, self.draft_ids, target),
        }

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, target) -> MedusaDrafter:
        """Load a checkpoint written by :meth:`save` for ``target``.

        Raises:
            ModelError: not a medusa checkpoint, or its weights or sizes do not fit.
        """
        path = Path(path)
        saved, state, draft_ids = read_head(path, cls.name, ("heads",))
        head_cfg = saved["heads"]
        check_head_fits(path, saved, head_cfg, draft_ids, target)
        head = target.model.get_output_embeddings()
        model = MedusaHeads(head_cfg, head)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ModelError(f"{path}: weights do not fit the config: {err}") from None
        model.to(target.device)
        layer = target.resolve_layers([LAST])[0]
        decay = saved.get("head_weight_decay", 0.8)
        backbone = None
        if saved.get("lora"):
            from specdec.drafters.medusa_adapted import ADAPTER_DIR, load_adapter

            try:
                backbone = load_adapter(target.model, path / ADAPTER_DIR)
            except (OSError, ValueError, KeyError, RuntimeError) as err:
                raise ModelError(f"{path}: unreadable Medusa-2 adapter ({err})") from None
        weight = saved.get("backbone_weight", 5.0)
        return cls(model, layer, draft_ids, target.vocab_size, decay, backbone, weight)

    def save(self, path: str | os.PathLike, *, target_name: str, extra: dict | None = None) -> Path:
        """Write a checkpoint directory atomically: it is complete or it does not exist."""
        config = {
            "heads": self.model.cfg,
            "target_vocab_size": self.vocab_size,
            "head_weight_decay": self.decay,
        }
        files = None
        if self.backbone is not None:
            from specdec.drafters import medusa_adapted

            config["lora"] = medusa_adapted.lora_settings(self.backbone)
            config["backbone_weight"] = self.backbone_weight

            def files(tmp: Path) -> None:
                medusa_adapted.save_adapter(self.backbone, tmp / medusa_adapted.ADAPTER_DIR)

        meta = {"num_heads": self.model.cfg["num_heads"]}
        return write_head(
            path, self, target_name=target_name, extra=extra, meta=meta, config=config,
            files=files,
        )  # fmt: skip

    # ----------------------------------------------------------------------- serving layouts

    def export_layout(self, fmt: str, target) -> tuple[dict, dict]:
        """``(config.json, weights)`` of the heads in a serving engine's layout (Medusa-2's
        adapted backbone comes beside them, :meth:`export_extras`)."""
        from specdec.drafters import medusa_layouts

        return medusa_layouts.export(self, fmt, target)

    def export_extras(self, fmt: str, target, directory: Path, final: Path) -> dict:
        """Medusa-2: the model its heads read and its proposals are verified by, the target
        with the adapters merged, as a transformers checkpoint in ``base_model/`` (verified by
        a reload with equal logits); the Medusa layout's ``base_model_name_or_path`` names it."""
        if self.backbone is None:
            return {}
        from specdec.drafters.medusa_adapted import save_merged

        where = save_merged(target, self.backbone, directory / BASE_MODEL_DIR)
        return {"base_model_name_or_path": str(final / where.name)} if fmt == "medusa" else {}

    @property
    def layout_module(self) -> torch.nn.Module:
        return self.model  # the heads: a layout holds no adapters

    def step_vocab(self, step: int) -> torch.Tensor | None:
        """Medusa-2's step 0 is the backbone's own full-vocabulary distribution; the heads'
        steps are over their vocabulary."""
        return None if self.adapted is not None and step == 0 else self.draft_ids

    @staticmethod
    def layout_keys(fmt: str, config: dict) -> set[str]:
        """The weights the layout's loader reads, from its ``config.json``."""
        from specdec.drafters import medusa_layouts

        return medusa_layouts.expected_keys(fmt, config)

    @classmethod
    def from_layout(cls, fmt: str, config: dict, state: dict, target) -> MedusaDrafter:
        """Heads back from an export (to verify it).

        Raises:
            ModelError: the weights do not fit, or a full-vocabulary LM head is not the
                target's (specdec's heads read out through it).
        """
        from specdec.drafters import medusa_layouts

        heads_cfg, heads_state, draft_ids, head = medusa_layouts.specdec_state(fmt, config, state)
        target_head = target.model.get_output_embeddings()
        if not heads_cfg["own_head"] and not torch.equal(
            head.to(target_head.weight.device), target_head.weight.detach()
        ):
            raise ModelError(f"{fmt} export: its LM head is not the target's")
        model = MedusaHeads(heads_cfg, target_head)
        try:
            model.load_state_dict(heads_state, strict=True)
        except RuntimeError as err:
            raise ModelError(f"{fmt} export: weights do not fit its config: {err}") from None
        layer = target.resolve_layers([LAST])[0]
        return cls(model.to(target.device), layer, draft_ids, target.vocab_size)

    # ------------------------------------------------------------------------- training face

    @property
    def module(self) -> torch.nn.Module:
        return self.adapted if self.adapted is not None else self.model

    def step_weights(self) -> torch.Tensor:
        heads = self.decay ** torch.arange(self.model.cfg["num_heads"], dtype=torch.float32)
        if self.adapted is None:
            return heads
        return torch.cat([torch.tensor([self.backbone_weight]), heads])

    def verifier(self, model):
        """Medusa-2: the adapted backbone (adapters merged into a copy of the adapted weights);
        Medusa-1: the target."""
        if self.backbone is None:
            return model
        from specdec.drafters.medusa_adapted import merged_copy

        return merged_copy(model, self.backbone)

    # ------------------------------------------------------------------------- decoding face

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        self.forward, self.confidence, self.tree = checked_forward(forward), confidence, tree

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        self.model.eval()
        dtype = decoding_dtype(self.forward, self.model, ("linear",))  # its modules' F.linear
        self.decoder = self._copy.get(self.model, dtype)  # made (again) here, not in a round
        self.h = None
        self.commit(0, target_features)

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        if not target_features:
            raise ModelError("the medusa heads need the target's last hidden state")
        rows = target_features[self.required_target_layers[0]]
        if len(rows):
            self.h = rows[-1]

    @torch.inference_mode()
    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        t0 = self.clock()
        model = self.decoder  # head i drafts depth i + 1
        k = min(k, model.cfg["num_heads"])  # (Medusa-2's steps count its backbone too)
        if self.tree is not None:
            logits = model.heads(self.h)  # [K, D]

            def feed(nodes: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
                depth = {-1: 0}
                for j, parent in enumerate(parents):
                    depth[j] = depth[parent] + 1
                return logits[[depth[j] for j in nodes]]  # a node at depth d: head d's

            proposal = draft_tree(
                self.tree, logits[0], feed, k, params, generator, self.draft_ids, self.vocab_size
            )
        else:
            proposal = draft_chain(
                model.head(0, self.h), lambda token, i: model.head(i + 1, self.h), k, params,
                generator, self.draft_ids, self.vocab_size, self.confidence,
            )  # fmt: skip
        self.seconds += self.clock() - t0
        return proposal

    @property
    def draft_seconds(self) -> float:
        return self.seconds
