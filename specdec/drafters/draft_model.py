"""An independent small causal LM as the drafter (Leviathan et al. 2023; DistillSpec, Zhou et
al. 2024, for training it against the target).

Decoding face: the draft model keeps its own KV cache (a :class:`ModelSession`), re-syncs it
with the accepted sequence by prefix, and drafts k tokens autoregressively, returning the exact
distributions it sampled from. An optional reduced output vocabulary (``vocab_map``: draft
output index -> target token id) makes its LM head cheap; its q is scattered back onto the
target vocabulary, zero elsewhere, so rejection sampling stays exact.

Training face: :func:`build_draft_model` makes a small model of the target's own architecture
(optionally initialised from the target's embeddings, final norm, head and chosen layers);
``module`` is that model as one step of ``[1, B, T, D]`` logits (it reads no target features),
and the base class's ``teacher`` reads the target's distribution at the same D tokens.

Checkpoints: :meth:`DraftModelDrafter.save` writes, and :mod:`specdec.drafters.checkpoint`
reads, a transformers directory with the target's tokenizer, ``drafter.json`` and, for a
reduced vocabulary, ``vocab_map.safetensors``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config.schema import DrafterConfig, option
from specdec.config.validation import Invalid
from specdec.decoding import compact
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import Kept, ModelSession
from specdec.drafters.base import FORWARDS, Proposal, TrainableDrafter, draft_chain
from specdec.drafters.checkpoint import (
    CHECKPOINT_FILE,
    REDUCED_VOCAB_ATTR,
    VOCAB_MAP_FILE,
    load_draft_model,
    load_reduced,
    read_meta,
)
from specdec.drafters.draft_model_init import (
    chosen_layers,
    copy_from_target,
    draft_config,
    layers_match,
    reduce_head,
)
from specdec.drafters.tree import Slots, draft_tree
from specdec.drafters.vocabulary import draft_vocab
from specdec.errors import ConfigError, ModelError
from specdec.files import atomic_dir

logger = logging.getLogger(__name__)

#: how the draft runs while decoding: ``auto`` (the compact forward in its default dtype where
#: the architecture allows, else transformers), ``transformers`` (the model's own forward), or
#: the compact forward in a given dtype
DRAFT_FORWARDS = FORWARDS


@dataclass
class DraftModelConfig(DrafterConfig):
    type: str = option("draft_model", "Drafter family (registry name).")
    num_layers: int = option(2, "Decoder layers of the drafter.", ge=1)
    hidden_size: int | None = option(None, "Drafter hidden size; null: the target's.", ge=1)
    intermediate_size: int | None = option(None, "MLP size; null: the target's.", ge=1)
    num_attention_heads: int | None = option(None, "Attention heads; null: the target's.", ge=1)
    num_key_value_heads: int | None = option(None, "Key/value heads; null: the target's.", ge=1)
    init_from_target: bool = option(True, "Copy embeddings, head and layers from the target.")
    init_layers: list[int] = option(
        [], "Target layers copied into the drafter (negatives count from the end); []: spread."
    )
    draft_vocab_size: int | None = option(
        None, "Reduced output vocabulary (most frequent target tokens); null: the full one.", ge=1
    )
    freeze_embeddings: bool = option(
        False, "Keep the input embedding as built (the target's, with init_from_target) while "
        "training; a full-vocabulary head tied to it stays frozen with it.",
    )  # fmt: skip

    def check(self) -> None:
        if self.init_layers and len(self.init_layers) != self.num_layers:
            n = len(self.init_layers)
            message = f"expected drafter.num_layers ({self.num_layers}) entries, got {n}"
            raise Invalid("drafter.init_layers", message, also=["drafter.num_layers"])


class NextTokenModule(torch.nn.Module):
    """A causal LM as a trainable drafter module: one step, row t predicting token t + 1."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, features=(), at=None) -> torch.Tensor:
        """``[1, B, T, D]`` logits (the target's features are not read); with ``at``, the rows
        read, ``[1, N, D]`` at those rows, in ``x[at]``'s order: the LM head runs there alone
        when the model's logits are its LM head on the decoder's output (no soft-capping or
        scaling between them), else at every row."""
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if at is None or not _plain_read_out(self.lm.config):
            out = self.lm(**kw).logits
            return (out if at is None else out[at]).unsqueeze(0)
        hidden = self.lm.get_decoder()(**kw).last_hidden_state  # [B, T, H], normed
        return self.lm.get_output_embeddings()(hidden[at]).unsqueeze(0)


def _plain_read_out(config) -> bool:
    """Whether a transformers causal LM's logits are its LM head on its decoder's output."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "final_logit_softcapping", None) is None and getattr(
        text, "logit_scale", None
    ) in (None, 1.0)


class DraftModelDrafter(TrainableDrafter):
    """Drafts with a small causal LM that reads target token ids.

    Args:
        model: a transformers causal LM whose input vocabulary is the target's.
        target_vocab_size: size of the target's output distribution.
        vocab_map: ``[D]`` target ids of the draft's D output logits, or None when the draft
            predicts the full target vocabulary.
        tokenizer: the target's tokenizer, saved beside the weights by :meth:`save`.
        forward: one of :data:`DRAFT_FORWARDS` (see :meth:`use_forward`).
        confidence: stop drafting once the draft's own probability of its chain so far (the
            product of the probabilities of the tokens it chose) falls below this; 0 drafts
            all k. The first token is always drafted. A dynamic draft length in the spirit of
            EAGLE-2 and transformers' ``assistant_confidence_threshold``: it depends only on
            the draft's distributions, so decoding stays exact.
    """

    name = "draft_model"
    config_class = DraftModelConfig
    branches = True

    def __init__(
        self,
        model,
        target_vocab_size: int,
        vocab_map: torch.Tensor | None = None,
        tokenizer=None,
        forward: str = "auto",
        confidence: float = 0.0,
    ):
        self.model = model.eval()
        self._module: NextTokenModule | None = None
        self.confidence = confidence
        self.session: ModelSession | None = None
        self.use_forward(forward)
        self.target_vocab_size = target_vocab_size
        self.vocab_map = None if vocab_map is None else vocab_map.to(self.session.device)
        self.tokenizer = tokenizer

    @classmethod
    def from_checkpoint(cls, path: str, target) -> DraftModelDrafter:
        """Load a checkpoint written by :meth:`save` (full or reduced vocabulary).

        Raises:
            ModelError: not a draft_model checkpoint, or it does not fit the target.
        """
        meta = read_meta(path)
        if meta.get("type") != cls.name:
            raise ModelError(f"{path}: a '{meta.get('type')}' checkpoint, not '{cls.name}'")
        if meta.get("target") and meta["target"] != target.name:
            logger.warning(
                "%s was trained for %s, loading for %s", path, meta["target"], target.name
            )
        if (Path(path) / VOCAB_MAP_FILE).is_file():
            return load_reduced(Path(path), target)
        return load_draft_model(
            str(path), target.tokenizer, target.vocab_size, device=target.device
        )

    @classmethod
    def build(cls, target, cfg: DraftModelConfig, token_counts=None) -> DraftModelDrafter:
        """A fresh draft model for ``target`` (see :func:`build_draft_model`)."""
        return build_draft_model(target, cfg, token_counts)

    # ------------------------------------------------------------------------ training face

    @property
    def module(self) -> torch.nn.Module:
        """The draft LM as a one-step trainable module (``[1, B, T, D]`` logits)."""
        if self._module is None:
            self._module = NextTokenModule(self.model)
        return self._module

    @property
    def draft_ids(self) -> torch.Tensor | None:
        return self.vocab_map

    def prepare_training(self, config: DraftModelConfig, target) -> None:
        """``freeze_embeddings``: the input embedding is not trained (nor its tied head)."""
        if not config.freeze_embeddings:
            return
        embedding = self.model.get_input_embeddings()
        embedding.requires_grad_(False)
        head = self.model.get_output_embeddings()
        if head is not None and head.weight is embedding.weight:
            logger.warning("drafter.freeze_embeddings: the LM head is tied to the embedding "
                           "and stays frozen with it")  # fmt: skip

    def transformers_model(self, where: str = ""):
        if self.vocab_map is not None:
            raise ModelError(
                f"{where or self.name}: this drafter has a reduced output vocabulary "
                f"({len(self.vocab_map)} tokens), which plain transformers cannot use: it needs "
                "specdec's decoder, or re-training with drafter.draft_vocab_size: null"
            )
        return self.model

    def save(self, path: str | os.PathLike, *, target_name: str, extra: dict | None = None) -> Path:
        """Write a checkpoint directory atomically: it is complete or it does not exist.

        Args:
            path: the checkpoint directory; an existing one is replaced.
            target_name: the target it was trained for (recorded in ``drafter.json``).
            extra: more entries for ``drafter.json`` (step, metrics, ...).
        """
        from safetensors.torch import save_file

        import specdec

        if self.tokenizer is None:
            raise ValueError("a draft model is saved with its target's tokenizer; none was given")
        meta = {
            "type": self.name,
            "target": target_name,
            "draft_vocab_size": None if self.vocab_map is None else len(self.vocab_map),
            "num_layers": self.model.config.get_text_config().num_hidden_layers,
            "specdec_version": specdec.__version__,
        }
        if clash := set(meta) & set(extra or {}):
            raise ValueError(f"extra entries would overwrite {sorted(clash)}")
        meta.update(extra or {})
        with atomic_dir(path) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            if self.vocab_map is not None:
                save_file({"vocab_map": self.vocab_map.cpu().contiguous()}, tmp / VOCAB_MAP_FILE)
            (tmp / CHECKPOINT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return Path(path)

    # ------------------------------------------------------------------------ decoding face

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        self.use_forward(forward)
        self.confidence, self.tree = confidence, tree

    def use_forward(self, forward: str) -> None:
        """Choose how the draft runs while decoding (one of :data:`DRAFT_FORWARDS`).

        The compact forward (:mod:`specdec.decoding.compact`) computes what the model computes
        from a copy of its weights, by default on a CPU in float16 or its own dtype, whichever
        multiplies its weights faster there (a draft step is bound by reading them); the
        distributions it reports are the ones it sampled from, so decoding stays exact
        whatever the dtype.

        Raises:
            ConfigError: an unknown choice, or a dtype for an architecture without the compact
                forward.
        """
        if forward not in DRAFT_FORWARDS:
            raise ConfigError(f"draft forward: expected one of {DRAFT_FORWARDS}, got {forward!r}")
        if forward not in ("auto", "transformers") and not compact.supports(self.model):
            raise ConfigError(
                f"draft forward {forward!r}: {type(self.model).__name__} has no compact forward "
                f"(supported: {', '.join(compact.COMPACT_MODEL_TYPES)}); use 'transformers'"
            )
        seconds = self.session.forward_seconds if self.session is not None else 0.0
        self.forward = forward
        self.session = self._new_session()
        self._fed = None
        self.session.forward_seconds = seconds

    def _new_session(self) -> ModelSession:
        if self.forward == "transformers" or not compact.supports(self.model):
            return ModelSession(self.model)
        dtype = None if self.forward == "auto" else getattr(torch, self.forward)
        return compact.CompactSession(self.model, dtype=dtype)

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        device = next(self.model.parameters()).device
        if device != self.session.device:  # moved since (e.g. by the trainer): follow it
            self.use_forward(self.forward)
        if self.vocab_map is not None:
            self.vocab_map = self.vocab_map.to(device)
        self.session.reset()
        self._fed = None  # the last tree's fed nodes: (base, {token path: cache slot})

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        if self._fed is not None:
            self._keep_accepted(sequence)
        new = self.session.sync(sequence)
        if not new:  # the cache holds the whole sequence: re-feed its last token for logits
            self.session.rollback(len(sequence) - 1)
            new = list(sequence[-1:])
        logits = self.session.extend(new, last_only=True)[-1]

        def fit(logits: torch.Tensor) -> torch.Tensor:
            return logits if self.vocab_map is not None else _fit(logits, self.target_vocab_size)

        if self.tree is not None:
            return self._propose_tree(fit(logits), fit, k, params, generator)

        def advance(token: torch.Tensor, i: int) -> torch.Tensor:
            return fit(self.session.extend(token.view(1))[-1])

        return draft_chain(
            fit(logits),
            advance,
            k,
            params,
            generator,
            self.vocab_map,
            self.target_vocab_size,
            self.confidence,
        )

    def _propose_tree(self, logits, fit, k, params, generator) -> Proposal:
        """Draft a tree: one forward per depth over the nodes it expands, each under the tree
        mask. The fed nodes stay in the cache until the next round keeps those on the path
        the target accepted (:meth:`_keep_accepted`)."""
        base = self.session.length
        slots, paths, fed = Slots(base), {-1: ()}, {}

        def feed(nodes: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
            positions, mask = slots.feed(nodes, parents)
            for j, token in zip(nodes, tokens.tolist(), strict=True):
                paths[j] = paths[parents[j]] + (token,)
                fed[paths[j]] = slots.slot[j]  # siblings differ, so a token path names a node
            return fit(self.session.extend(tokens, positions=positions, mask=mask))

        proposal = draft_tree(
            self.tree, logits, feed, k, params, generator, self.vocab_map, self.target_vocab_size
        )
        self._fed = (base, fed)
        return proposal

    def _keep_accepted(self, sequence: Sequence[int]) -> None:
        """Keep the cache entries of the last tree's fed nodes on the accepted path (the
        sequence after the tree's root, its last token excepted: the draft's next logits come
        from feeding it, and it may be a fed node the tree did not propose), drop the rest."""
        (base, fed), self._fed = self._fed, None
        kept, path = [], ()
        for token in sequence[base:-1]:
            path += (token,)
            if path not in fed:
                break
            kept.append(fed[path])
        self.session.keep(Kept(base, kept))

    @property
    def draft_seconds(self) -> float:
        return self.session.forward_seconds


def _fit(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Match the target's logit width: models of one tokenizer may pad their vocabularies
    differently; padded rows are never real tokens."""
    if logits.shape[-1] >= size:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))


# ---------------------------------------------------------------------------------- building


def build_draft_model(target, cfg, token_counts: torch.Tensor | None = None) -> DraftModelDrafter:
    """A fresh draft model of the target's architecture, ready to train.

    Args:
        target: the :class:`~specdec.target.FrozenTarget`.
        cfg: the recipe's ``DrafterConfig`` (num_layers, size overrides, init_from_target,
            init_layers, draft_vocab_size).
        token_counts: ``[V]`` counts of each target token in the training answers; needed
            when ``draft_vocab_size`` reduces the output vocabulary.

    Returns:
        A drafter in float32 on the target's device. Layers ``init_layers`` of the target
        (``[]``: spread evenly, first to last) become its layers; with ``init_from_target``
        their weights, the embeddings, the final norm and the head are copied.

    Raises:
        ConfigError: the recipe asks to copy weights whose shapes it changed.
        ValueError: a reduced vocabulary without ``token_counts``.
    """
    from transformers import AutoModelForCausalLM

    layers = chosen_layers(target, cfg)
    config = draft_config(target, cfg, layers)
    vocab_map = draft_vocab(target, cfg.draft_vocab_size, token_counts)
    if vocab_map is not None:
        config.tie_word_embeddings = False
        setattr(config, REDUCED_VOCAB_ATTR, len(vocab_map))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = type(target.model.generation_config).from_dict(
        target.model.generation_config.to_dict()
    )
    if cfg.init_from_target:
        copy_from_target(model, target, layers, copy_layers=layers_match(config, target, cfg))
    if vocab_map is not None:
        reduce_head(model, vocab_map)
    model.to(target.device)
    return DraftModelDrafter(model, target.vocab_size, vocab_map, tokenizer=target.tokenizer)
