"""The frozen target: the large model whose distribution speculative decoding must reproduce.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling") keeps the target exactly as it is: drafters are trained on its logits and hidden
states and verified against its logits. :class:`FrozenTarget` loads it from one spec and gives
one forward that returns the logits plus the hidden layers a drafter asked for. It never trains.

A target spec names the embedded default, a GGUF file, a local directory or a hub id (see
:mod:`specdec.target_files`).

Hidden layer indices count decoder layers from 0; layer ``i`` is transformers'
``hidden_states[i + 1]`` (``hidden_states[0]`` is the embeddings). Negative indices count from
the end. The last layer (``-1``, i.e. ``num_layers - 1``) is special, as in transformers: it is
returned *after* the model's final norm, so it is exactly what the LM head reads
(``logits == lm_head(hidden[-1])``); every other layer is the raw residual stream after that
decoder layer.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec.errors import ModelError
from specdec.layers import resolve_layer
from specdec.target_files import resolve_target_path

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unknown target dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _torch_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        out = torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown target device {device!r}") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            f"target device {str(device)!r}: no CUDA device here (torch {torch.__version__}); "
            "use cpu or auto"
        )
    return out


def load_target_model(
    model: str,
    *,
    gguf_file: str | None = None,
    revision: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "auto",
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target spec as a transformers causal LM and tokenizer, in eval mode on ``device``.

    Args:
        model: the target spec (see the module docstring).
        gguf_file: GGUF file name inside a local directory or hub repo.
        revision: hub revision (branch, tag or commit).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (or a ``torch.dtype``).
        device: ``auto`` (cuda if available, else cpu) or any torch device string.
        cache_dir: specdec cache root for the embedded and GGUF targets.
        attn_implementation: transformers attention backend, e.g. ``sdpa``.
        trust_remote_code: allow custom modeling code from a hub repo.

    Raises:
        ModelError: the spec cannot be found or loaded, or dtype/device are unknown.
    """
    torch_dtype, torch_device = _torch_dtype(dtype), _torch_device(device)
    path, gguf = resolve_target_path(model, gguf_file=gguf_file, cache_dir=cache_dir)
    common: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf is not None:
        common["gguf_file"] = gguf
    if revision is not None:
        common["revision"] = revision
    model_kwargs: dict[str, Any] = {"dtype": torch_dtype, **common}
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    start = time.perf_counter()
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
    except (OSError, ValueError, SafetensorError) as err:  # a truncated weights file too
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelError(f"could not load target {model!r}: {reason}") from err
    lm.to(torch_device).eval()
    logger.info(
        "loaded target %s from %s%s (%s, %s) in %.1f s",
        model,
        path,
        f" [{gguf}]" if gguf else "",
        torch_dtype,
        torch_device,
        time.perf_counter() - start,
    )
    return lm, tokenizer


@dataclass
class TargetOutput:
    """What one target forward returns.

    Attributes:
        logits: ``[B, T, V]`` next-token logits.
        hidden_states: resolved layer index -> ``[B, T, H]``, for the layers requested only.
        past_key_values: the transformers cache object when a cache was used, else None.
    """

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    past_key_values: Any = None


class FrozenTarget:
    """A causal LM that is only ever evaluated: eval mode, no parameter requires grad.

    Args:
        model: a transformers causal LM.
        tokenizer: its tokenizer.
        name: short identity of the target (the spec it was loaded from).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        # transformers 5 renamed the cache argument; older releases only know the old name
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params

    @classmethod
    def load(cls, model: str, **kwargs: Any) -> FrozenTarget:
        """Load a target spec; ``kwargs`` are those of :func:`load_target_model`."""
        lm, tokenizer = load_target_model(model, **kwargs)
        return cls(lm, tokenizer, name=model)

    @classmethod
    def from_config(cls, cfg: Any) -> FrozenTarget:
        """Load from a ``TargetConfig`` (or any object with the same attributes)."""
        return cls.load(
            cfg.model,
            gguf_file=cfg.gguf_file,
            revision=cfg.revision,
            dtype=cfg.dtype,
            device=cfg.device,
            cache_dir=cfg.cache_dir,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )

    @property
    def config(self):
        return self.model.config

    @property
    def _text_config(self):
        return self.model.config.get_text_config()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return self._text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self._text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed ``len(tokenizer)`` when the vocabulary is padded)."""
        head = self.model.get_output_embeddings()
        return head.out_features if head is not None else self._text_config.vocab_size

    def resolve_layers(self, layers: Sequence[int]) -> list[int]:
        """Map layer indices (negatives count from the end) to ``0..num_layers - 1``.

        Raises:
            ModelError: an index is out of range; the message names it and the valid range.
        """
        n = self.num_layers
        for layer in layers:
            if not -n <= layer < n:
                raise ModelError(
                    f"hidden layer {layer} out of range for target {self.name} with {n} layers "
                    f"(valid: {-n}..{n - 1})"
                )
        return list(dict.fromkeys(resolve_layer(layer, n) for layer in layers))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        past_key_values: Any = None,
        use_cache: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target once.

        Args:
            input_ids: ``[B, T]`` token ids (only the new ones when a cache is given).
            attention_mask: ``[B, T_past + T]`` padding mask or a 4-D mask, as transformers takes.
            position_ids: ``[B, T]``; None: counted on from the cache length.
            hidden_layers: decoder layers to return (see the module docstring for the indexing;
                ``-1`` is after the final norm). Hidden states are computed only when asked.
            past_key_values: a transformers cache from an earlier call; updated in place.
            use_cache: build and return a cache (implied when ``past_key_values`` is given).
            logits_at: ``[B, T]`` bool: compute the logits at these positions only (the LM
                head is skipped elsewhere where transformers supports it).

        Returns:
            :class:`TargetOutput` with logits ``[B, T, V]`` (with ``logits_at``: ``[N, V]``,
            its true positions in order) and ``{layer: [B, T, H]}``.
        """
        layers = self.resolve_layers(hidden_layers)
        if self.model.training:  # someone called .train() on the inner model: undo it
            self.model.eval()
        use_cache = use_cache or past_key_values is not None
        device = self.device
        kwargs: dict[str, Any] = {"use_cache": use_cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(device)
        if past_key_values is not None:
            kwargs[self._cache_arg] = past_key_values
        if layers:
            # an index list keeps only those states where transformers supports it; elsewhere
            # it is just a true flag and all states come back, indexed the same way
            kwargs["output_hidden_states"] = [i + 1 for i in layers]
        if logits_at is not None and self._keeps_logits:
            kwargs["logits_to_keep"] = logits_at.to(device)
        out = self.model(input_ids=input_ids.to(device), **kwargs)
        hidden = {i: out.hidden_states[i + 1] for i in layers}
        cache = out.get("cache", out.get("past_key_values")) if use_cache else None
        logits = out.logits
        if logits_at is not None and logits.dim() == 3:  # a model that computed them all
            logits = logits[logits_at.to(logits.device)]
        return TargetOutput(logits=logits, hidden_states=hidden, past_key_values=cache)

    __call__ = forward

    def train(self, mode: bool = True) -> FrozenTarget:
        """Stay in eval mode whatever ``mode`` says: the target is frozen. No error, so code that
        switches every model it holds between train and eval keeps working."""
        self.model.eval()
        return self

    def eval(self) -> FrozenTarget:
        self.model.eval()
        return self

    def __repr__(self) -> str:
        return (
            f"FrozenTarget({self.name!r}, layers={self.num_layers}, hidden={self.hidden_size}, "
            f"vocab={self.vocab_size}, dtype={self.dtype}, device={self.device})"
        )


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a sequence: the tokenizer's EOS first, then the generation
    config's (chat models often stop on an end-of-turn token as well)."""
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        for t in source if isinstance(source, list) else [source]:
            if t is not None and t not in ids:
                ids.append(int(t))
    if not ids:
        raise ModelError(f"neither tokenizer {tokenizer.name_or_path!r} nor the model has an EOS")
    return ids
