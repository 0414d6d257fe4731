"""Drafter families, by registry name: the only place that knows which families exist.

Each family is one module with the same shape (see :mod:`specdec.drafters.base`): a config
dataclass (the recipe's ``drafter:`` section when ``drafter.type`` names it), ``build(target,
config, token_counts)``, ``from_checkpoint(path, target)``, and the decoding face; trainable
families add the training face. Everything outside this package reaches a family through the
functions below.
"""

from __future__ import annotations

import difflib
import os

from specdec.drafters.base import Drafter, Proposal, Teacher, TrainableDrafter
from specdec.drafters.checkpoint import read_meta
from specdec.drafters.draft_model import DraftModelDrafter, load_draft_model
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.mtp import MTPDrafter
from specdec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from specdec.drafters.vocabulary import token_counts
from specdec.errors import ConfigError, ModelError

REGISTRY: dict[str, type[Drafter]] = {
    "draft_model": DraftModelDrafter,
    "eagle3": Eagle3Drafter,
    "medusa": MedusaDrafter,
    "mtp": MTPDrafter,
    "prompt_lookup": PromptLookupDrafter,
}
#: the family of a recipe whose ``drafter:`` section names none
DEFAULT_FAMILY = "draft_model"


def drafter_class(name: str) -> type[Drafter]:
    """The drafter family called ``name``; a clear error names the known ones."""
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown drafter '{name}'{hint}; available: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name]


def config_classes() -> dict[str, type]:
    """Family name -> the dataclass of its ``drafter:`` section."""
    return {name: cls.config_class for name, cls in REGISTRY.items()}


def layout_formats() -> dict[str, list[str]]:
    """Serving layouts that families write themselves (``layouts``: format -> weights file):
    format name -> the families that have it (a format such as ``speculators`` holds several
    families, each its own way)."""
    formats: dict[str, list[str]] = {}
    for name, cls in REGISTRY.items():
        for fmt in getattr(cls, "layouts", {}):
            formats.setdefault(fmt, []).append(name)
    return formats


def is_trainable(name: str) -> bool:
    return issubclass(drafter_class(name), TrainableDrafter)


def build(target, config, token_counts=None) -> Drafter:
    """A fresh drafter of the family ``config.type`` for ``target`` (untrained where trained)."""
    return drafter_class(config.type).build(target, config, token_counts)


def for_recipe(config, target, dataset) -> TrainableDrafter:
    """A recipe's drafter (its ``drafter`` section): from ``from_pretrained``, or built fresh
    for ``target`` with the token counts of the training ``dataset``."""
    path = config.from_pretrained
    if not path:
        drafter = build(target, config, token_counts(dataset, target.vocab_size))
    else:
        family = family_of(path)
        if family != config.type:
            raise ConfigError(
                f"drafter.from_pretrained: {path} holds a '{family}' drafter, not '{config.type}'"
            )
        drafter = load(path, target)
        for key, (wanted, held) in drafter.loaded_shape(config, target).items():
            if wanted != held:
                raise ConfigError(
                    f"drafter.{key}: {wanted} in the recipe, but drafter.from_pretrained {path} "
                    f"holds {held}; a loaded drafter keeps its shape: set the checkpoint's value"
                )
    drafter.prepare_training(config, target)
    return drafter


def load(path: str | os.PathLike, target) -> Drafter:
    """A drafter saved by specdec, whatever its family (``drafter.json`` names it)."""
    family = read_meta(path).get("type")
    if family not in REGISTRY:
        raise ModelError(f"{path}: a checkpoint of unknown drafter family {family!r}")
    return REGISTRY[family].from_checkpoint(path, target)


def family_of(path: str | os.PathLike) -> str | None:
    """The family a checkpoint directory says it holds."""
    return read_meta(path).get("type")


def config_for(name: str, **values):
    """The ``name`` family's config with ``values`` set where it has such fields (a command's
    flags apply to the families they concern)."""
    cls = drafter_class(name).config_class
    known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__ and v is not None}
    return cls(**known)


def has_option(name: str, option: str) -> bool:
    """Whether the ``name`` family's config has ``option`` (a command's setting applies)."""
    return option in drafter_class(name).config_class.__dataclass_fields__


def from_model(model, target) -> Drafter:
    """Any transformers causal LM that shares the target's tokenizer, as a drafter: a model
    object, or a path or hub id to load."""
    vocab = target.model.get_output_embeddings().weight.shape[0]
    if isinstance(model, str):
        return load_draft_model(model, target.tokenizer, vocab, device=target.device)
    return DraftModelDrafter(model, vocab, tokenizer=target.tokenizer)


#: how method specs (``specdec eval``) name a hybrid over another drafter, and a transformers
#: causal LM drafting as a draft model: ``prompt_lookup+PATH``, ``draft_model:PATH``
HYBRID_PREFIX = PromptLookupDrafter.name + "+"
#: a hybrid's prompt lookup trusts matches of this many tokens or more (or its longest n-gram,
#: if shorter); the other drafter guesses as well after shorter ones (``bench/draft_misses.py``)
HYBRID_MIN_NGRAM = 3
#: the longest n-gram prompt lookup (alone or in a hybrid) tries unless a command sets it
LOOKUP_MAX_NGRAM = PromptLookupConfig().max_ngram
MODEL_PREFIX = DraftModelDrafter.name + ":"


def hybrid(inner: Drafter, **lookup_settings) -> Drafter:
    """Prompt lookup first, ``inner`` where it finds no continuation worth proposing (see
    :class:`~specdec.drafters.hybrid.HybridDrafter`).

    Args:
        inner: the drafter of the rounds prompt lookup leaves.
        lookup_settings: ``max_ngram``, ``min_ngram`` and ``copy_start`` of prompt lookup,
            ``min_match`` of the hybrid; None keeps the default (a command's unset flags).

    Raises:
        ConfigError: an unknown setting, or a value out of range.
    """
    settings = {k: v for k, v in lookup_settings.items() if v is not None}
    min_match = settings.pop("min_match", 2)
    if unknown := set(settings) - {"max_ngram", "min_ngram", "copy_start"}:
        raise ConfigError(f"unknown prompt lookup settings {sorted(unknown)}")
    longest = settings.setdefault("max_ngram", LOOKUP_MAX_NGRAM)
    settings.setdefault("min_ngram", min(HYBRID_MIN_NGRAM, longest))
    try:
        return HybridDrafter(PromptLookupDrafter(**settings), inner, min_match=min_match)
    except ValueError as err:
        raise ConfigError(f"prompt lookup: {err}") from None


def training_free() -> list[str]:
    """The families that need no training (baselines every trained drafter must beat)."""
    return [name for name in REGISTRY if not is_trainable(name)]


__all__ = [
    "DEFAULT_FAMILY",
    "HYBRID_MIN_NGRAM",
    "HYBRID_PREFIX",
    "LOOKUP_MAX_NGRAM",
    "MODEL_PREFIX",
    "REGISTRY",
    "Drafter",
    "HybridDrafter",
    "Proposal",
    "Teacher",
    "TrainableDrafter",
    "build",
    "config_classes",
    "config_for",
    "drafter_class",
    "family_of",
    "from_model",
    "has_option",
    "hybrid",
    "is_trainable",
    "load",
    "training_free",
]
