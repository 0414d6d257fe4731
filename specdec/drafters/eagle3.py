"""EAGLE-3: a one-layer draft head that reads the target's own hidden states (Li et al. 2025).

An independent draft model re-learns what the target already computed; EAGLE-3 starts from it.
The head fuses the target's hidden states of three layers (low, middle, high) at position t,
reads them beside the embedding of token t + 1, and predicts token t + 2 over a reduced draft
vocabulary; further draft steps feed the head its own output (the module and its
training-time test: :mod:`specdec.drafters.eagle3_model`).

Decoding face. The head keeps a KV cache whose first entries ("step 0") come from the target's
features of the verified prefix. ``propose`` first enters the features the target returned
since the last round, then drafts a chain on its own outputs (entries after the verified
prefix); ``commit`` drops those draft entries and queues the target's features of the kept
positions, which the verify forward already computed. q is the head's distribution over its
draft vocabulary, put back onto the target's (zero elsewhere), so decoding stays exact.

Checkpoints: ``model.safetensors`` (the head's weights and the ``d2t`` / ``t2d`` vocabulary
maps, as SpecForge and speculators store them), ``config.json`` (its sizes, the target layers
and the verifier) and ``drafter.json``. The target's embedding is borrowed, not saved.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config.schema import DrafterConfig, option
from specdec.config.validation import Invalid
from specdec.decoding.kernels import tuned_linear
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import Clock
from specdec.drafters import eagle3_layouts, vocabulary
from specdec.drafters.base import (
    DecodingCopy,
    Proposal,
    TrainableDrafter,
    checked_forward,
    decoding_dtype,
    draft_chain,
    vocab_shape,
)
from specdec.drafters.checkpoint import read_head, write_head
from specdec.drafters.eagle3_model import (
    DraftCache,
    Eagle3Model,
    head_config,
    init_from_target,
    new_model,
)
from specdec.drafters.tree import Slots, draft_tree
from specdec.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)


@dataclass
class Eagle3Config(DrafterConfig):
    type: str = option("eagle3", "Drafter family (registry name).")
    target_layers: list[int] = option(
        [], "Target layers fused by the head (low, middle, high), by output; []: 1, N/2-1 and "
        "N-4 of an N-layer target (the inputs of layers 2, N/2 and N-3, which vLLM and SGLang "
        "read by default). Negatives count from the end.",
    )  # fmt: skip
    num_layers: int = option(1, "Decoder layers of the head.", ge=1)
    draft_vocab_size: int | None = option(
        None, "Output vocabulary: the most frequent target tokens of the training answers; "
        "null: the target's whole vocabulary.", ge=1,
    )  # fmt: skip
    ttt_steps: int = option(
        3, "Training-time test: steps unrolled on the head's outputs.", ge=1, le=7
    )
    step_weight_decay: float = option(
        0.8, "Loss weight of unrolled step s: decay ** s.", gt=0, le=1
    )
    feature_noise: float = option(
        0.0, "Gaussian noise on the fused target features while training, relative to their "
        "standard deviation; 0 is off.", ge=0,
    )  # fmt: skip
    init_head_from_target: bool = option(
        True, "Start from the target's read-out: LM head (at the draft tokens) and final norm "
        "copied, fused features = the highest target layer, decoder layers as identity.",
    )  # fmt: skip
    freeze_lm_head: bool = option(
        False, "Keep the LM head as it starts while training (built fresh: the target's rows at "
        "the draft tokens, so it needs init_head_from_target): fewer weights to fit.",
    )  # fmt: skip

    recompute_attention: bool = option(
        False, "Training: recompute each unrolled step's attention in the backward instead of "
        "keeping its [B, heads, T, T] weights (same gradients, a little more compute; for long "
        "rows of a large target, see bench/train_memory.py).",
    )  # fmt: skip

    def check(self) -> None:
        if len(set(self.target_layers)) != len(self.target_layers):
            raise Invalid("drafter.target_layers", f"repeated layers in {self.target_layers}")
        if self.freeze_lm_head and not (self.init_head_from_target or self.from_pretrained):
            raise Invalid(
                "drafter.freeze_lm_head", "needs drafter.init_head_from_target: true (a frozen "
                "random head cannot learn)", also=("drafter.init_head_from_target",),
            )  # fmt: skip


def default_layers(num_layers: int) -> list[int]:
    """The layers serving engines read by default: vLLM and SGLang take the inputs of decoder
    layers 2, N // 2 and N - 3, which are the outputs of layers 1, N // 2 - 1 and N - 4 in
    specdec's numbering (distinct layers for small targets)."""
    if num_layers >= 8:
        return [1, num_layers // 2 - 1, num_layers - 4]
    return list(dict.fromkeys([0, num_layers // 2, num_layers - 1]))


def recipe_layers(cfg: Eagle3Config, target) -> list[int]:
    """The target layers a recipe's head fuses, resolved (non-negative).

    Raises:
        ConfigError: a layer out of the target's range, naming ``drafter.target_layers``.
    """
    try:
        return target.resolve_layers(cfg.target_layers or default_layers(target.num_layers))
    except ModelError as err:
        raise ConfigError(f"drafter.target_layers: {err}") from None


class Eagle3Drafter(TrainableDrafter):
    """The EAGLE-3 head as a drafter.

    Args:
        model: the head.
        target_layers: the target layers it fuses (resolved, non-negative).
        draft_ids: ``[D]`` target ids of its outputs, or None for the full vocabulary.
        vocab_size: the target's vocabulary size (width of q).
        step_weight_decay: loss weight of step s is ``decay ** s``.
    """

    name = "eagle3"
    branches = True
    #: serving layouts (format -> weights file), see :mod:`specdec.drafters.eagle3_layouts`
    layouts = {fmt: "model.safetensors" for fmt in eagle3_layouts.FORMATS}
    config_class = Eagle3Config
    shift = 1

    def __init__(
        self,
        model: Eagle3Model,
        target_layers: Sequence[int],
        draft_ids: torch.Tensor | None,
        vocab_size: int,
        step_weight_decay: float = 0.8,
    ):
        self.model = model
        self.required_target_layers = tuple(target_layers)
        self.draft_ids = draft_ids
        self.vocab_size = vocab_size
        self.steps = model.cfg["steps"]
        self.decay = step_weight_decay
        self.forward, self.confidence = "auto", 0.0
        self._copy = DecodingCopy()
        self.clock = Clock(model.fc.weight.device)
        self.seconds = 0.0

    # ------------------------------------------------------------------------------ building

    @classmethod
    def build(cls, target, cfg: Eagle3Config, token_counts=None) -> Eagle3Drafter:
        """A fresh head for ``target``, ready to train, on the target's device."""
        layers = recipe_layers(cfg, target)
        draft_ids = vocabulary.draft_vocab(target, cfg.draft_vocab_size, token_counts)
        size = target.vocab_size if draft_ids is None else len(draft_ids)
        head_cfg = head_config(target, len(layers), cfg.num_layers, size, cfg.ttt_steps)
        model = new_model(target, head_cfg)
        if cfg.init_head_from_target:
            init_from_target(model, target, draft_ids, layers[-1])
        model.to(target.device)
        return cls(model, layers, draft_ids, target.vocab_size, cfg.step_weight_decay)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, target) -> Eagle3Drafter:
        """Load a checkpoint written by :meth:`save` for ``target``.

        Raises:
            ModelError: not an eagle3 checkpoint, or its weights or sizes do not fit.
        """
        path = Path(path)
        saved, state, draft_ids = read_head(path, cls.name, ("head", "target_layers"))
        head_cfg, layers = saved["head"], saved["target_layers"]
        if head_cfg["target_hidden_size"] != target.hidden_size or max(layers) >= target.num_layers:
            raise ModelError(
                f"{path}: made for a target with hidden size {head_cfg['target_hidden_size']} "
                f"reading layers {layers}; {target.name} has {target.hidden_size} and "
                f"{target.num_layers} layers"
            )
        size = head_cfg["draft_vocab_size"]
        full = draft_ids is None and size == target.vocab_size
        fits = draft_ids is not None and len(draft_ids) == size
        if not (full or (fits and int(draft_ids.max()) < target.vocab_size)):
            raise ModelError(f"{path}: its draft vocabulary (d2t) does not fit its head or target")
        model = new_model(target, head_cfg)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ModelError(f"{path}: weights do not fit the config: {err}") from None
        model.to(target.device)
        decay = saved.get("step_weight_decay", 0.8)
        return cls(model, layers, draft_ids, target.vocab_size, decay)

    def prepare_training(self, config: Eagle3Config, target) -> None:
        """The recipe's training options; a head loaded from ``drafter.from_pretrained`` trains
        on with the recipe's training-time test (``ttt_steps``, ``step_weight_decay``: e.g. one
        step first, then three from it)."""
        self.model.cfg["steps"] = self.steps = config.ttt_steps
        self.decay = config.step_weight_decay
        self.model.feature_noise = config.feature_noise
        self.model.recompute_attention = config.recompute_attention
        self.model.lm_head.weight.requires_grad_(not config.freeze_lm_head)

    def loaded_shape(self, config: Eagle3Config, target) -> dict[str, tuple]:
        return {
            "target_layers": (recipe_layers(config, target), list(self.required_target_layers)),
            "num_layers": (config.num_layers, self.model.cfg["num_layers"]),
            "draft_vocab_size": vocab_shape(config, self.draft_ids, target),
        }

    def save(self, path: str | os.PathLike, *, target_name: str, extra: dict | None = None) -> Path:
        """Write a checkpoint directory atomically: it is complete or it does not exist."""
        layers = list(self.required_target_layers)
        config = {
            "head": self.model.cfg,
            "target_layers": layers,
            "target_vocab_size": self.vocab_size,
            "step_weight_decay": self.decay,
        }
        meta = {"target_layers": layers}
        return write_head(
            path, self, target_name=target_name, extra=extra, meta=meta, config=config
        )

    # ----------------------------------------------------------------------- serving layouts

    def export_layout(self, fmt: str, target) -> tuple[dict, dict]:
        """``(config.json, weights)`` of the head in a serving engine's layout."""
        if fmt == "sglang" and self.model.cfg["num_layers"] > 1:
            raise ModelError("the sglang layout holds one-layer heads (drafter.num_layers: 1)")
        config = eagle3_layouts.engine_config(self, fmt, target)
        return config, eagle3_layouts.engine_state(self.model, fmt, self.draft_ids, self.vocab_size)

    @staticmethod
    def layout_keys(fmt: str, config: dict) -> set[str]:
        """The weights the layout's loader reads, from its ``config.json``."""
        return eagle3_layouts.expected_keys(fmt, config)

    @classmethod
    def from_layout(cls, fmt: str, config: dict, state: dict, target) -> Eagle3Drafter:
        """A head back from an export (to verify it)."""
        proposals = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        head_cfg, layers = eagle3_layouts.head_config(
            config, fmt, proposals[0].get("speculative_tokens", 1)
        )
        model = new_model(target, head_cfg)
        try:
            model.load_state_dict(eagle3_layouts.specdec_state(state, fmt, model), strict=True)
        except RuntimeError as err:
            raise ModelError(f"{fmt} export: weights do not fit its config: {err}") from None
        draft_ids = vocabulary.from_d2t(state["d2t"])
        if head_cfg["draft_vocab_size"] == target.vocab_size:
            draft_ids = None
        return cls(model.to(target.device), layers, draft_ids, target.vocab_size)

    # ------------------------------------------------------------------------- training face

    @property
    def module(self) -> Eagle3Model:
        return self.model

    def step_weights(self) -> torch.Tensor:
        return self.decay ** torch.arange(self.steps, dtype=torch.float32)

    # ------------------------------------------------------------------------- decoding face

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        self.forward, self.confidence, self.tree = checked_forward(forward), confidence, tree

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        self.model.eval()
        self.decoder = self._decoder()
        weight = self.decoder.fc.weight
        # the kernels measured here (F.linear alone off a CPU), or the network's own forward's
        own = self.forward == "transformers"
        self.linear = torch.nn.functional.linear if own else tuned_linear(self.decoder)
        self.cache = DraftCache(self.decoder, weight.dtype)
        self.verified = 0  # cache entries made from the target's features (step 0)
        self.pending = self._fuse(target_features)  # [m, H] features not yet entered

    def _decoder(self) -> Eagle3Model:
        """The head that decodes: the trained one, or a copy in the decoding dtype."""
        return self._copy.get(self.model, decoding_dtype(self.forward, self.model))

    @torch.inference_mode()
    def _fuse(self, features: dict | None) -> torch.Tensor:
        if not features:
            raise ModelError("the eagle3 head needs the target's hidden states")
        return self.decoder.fuse([features[i] for i in self.required_target_layers])

    @torch.inference_mode()
    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        t0 = self.clock()
        model, m, start = self.decoder, self.pending.shape[0], self.verified
        if start + m != len(sequence) - 1:
            raise ModelError(
                f"eagle3 head out of step: {start + m} positions of features for a sequence "
                f"of {len(sequence)} tokens"
            )
        # step 0: entry at position j reads the target's features at j and the token j + 1
        ids = torch.as_tensor(sequence[start + 1 :], device=self.pending.device)
        x = model.decode(model.embedding(ids), self.pending, start, self.cache, self.linear)[-1:]
        self.verified, self.pending = start + m, self.pending[:0]
        logits = model.logits(x, self.linear)[0]  # [D]
        if self.tree is not None:
            proposal = self._propose_tree(logits, x, k, params, generator)
        else:
            proposal = self._propose_chain(logits, x, k, params, generator)
        self.seconds += self.clock() - t0
        return proposal

    def _propose_chain(self, logits, x, k, params, generator) -> Proposal:
        model, state = self.decoder, {"x": x}

        def advance(token: torch.Tensor, i: int) -> torch.Tensor:
            # the next entry reads the drafted token and the head's own output
            embeds = model.embedding(token.view(1))
            x = model.decode(embeds, state["x"], self.verified + i, self.cache, self.linear)
            state["x"] = x
            return model.logits(x, self.linear)[0]

        return draft_chain(
            logits, advance, k, params, generator, self.draft_ids, self.vocab_size, self.confidence
        )

    def _propose_tree(self, logits, x, k, params, generator) -> Proposal:
        """Each node's entry reads its token and its parent's output, attends to the verified
        entries and its ancestors, at position verified + depth - 1 (as step depth - 1 of
        training-time test does along a chain)."""
        model, slots, outputs = self.decoder, Slots(self.verified), {-1: x}

        def feed(nodes: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
            positions, mask = slots.feed(nodes, parents)
            hidden = torch.cat([outputs[parents[j]] for j in nodes])
            start = slots.end - len(nodes)
            out = model.decode(
                model.embedding(tokens), hidden, start, self.cache, self.linear, positions, mask
            )
            outputs.update((j, out[r : r + 1]) for r, j in enumerate(nodes))
            return model.logits(out, self.linear)

        return draft_tree(
            self.tree, logits, feed, k, params, generator, self.draft_ids, self.vocab_size
        )

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        t0 = self.clock()
        self.cache.length = self.verified  # the draft's own entries go
        self.pending = torch.cat([self.pending, self._fuse(target_features)])
        self.seconds += self.clock() - t0

    @property
    def draft_seconds(self) -> float:
        return self.seconds
