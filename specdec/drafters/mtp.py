"""MTP heads: DeepSeek-V3-style multi-token-prediction modules trained against a frozen target
that has none of its own (the module: :mod:`specdec.drafters.mtp_model`).

Training face: S = D steps, module k (step k - 1) at row t predicts token t + k + 1 from the
target's last hidden state (chained through the earlier modules) and the true tokens up to
t + k (``shift = 1``); loss weight of module k is ``decay ** (k - 1)``.

Decoding face: each module keeps the entries of the positions whose inputs are verified
(module k at position i reads module k - 1's output there and token i + k), entered as the
target's features arrive. A round drafts a chain: module 1 at the last verified position
drafts the first token; module j then enters the positions whose token i + j is drafted (the
draft so far) and drafts token j from the last of them. Commit drops the draft entries. q is
the module's processed distribution over its vocabulary, put back onto the target's (zero
elsewhere), so decoding stays exact.

Checkpoints: ``model.safetensors`` (the modules, and an own LM head with the ``d2t`` / ``t2d``
maps), ``config.json`` and ``drafter.json``.
"""

from __future__ import annotations

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
from specdec.drafters import mtp_layouts, vocabulary
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
from specdec.drafters.eagle3_model import head_config
from specdec.drafters.mtp_model import ModuleCache, MTPModel
from specdec.errors import ModelError

LAST = -1  # the target layer the first module reads: the last, after the final norm


@dataclass
class MTPConfig(DrafterConfig):
    type: str = option("mtp", "Drafter family (registry name).")
    num_modules: int = option(2, "Depth D: module k predicts the token k + 1 ahead.", ge=1, le=8)
    draft_vocab_size: int | None = option(
        None, "null: the modules read out through the target's LM head (frozen, shared, not "
        "saved); a number: through an LM head of their own over that many of the most frequent "
        "target tokens of the training answers.", ge=1,
    )  # fmt: skip
    step_weight_decay: float = option(0.8, "Loss weight of module k: decay ** (k - 1).", gt=0, le=1)
    init_from_target: bool = option(
        True, "Start each module as the target's read-out of its input: eh_proj passes the "
        "normed hidden state through, the layer adds nothing yet, the norms are the target's "
        "final norm.",
    )  # fmt: skip
    init_from: str | None = option(
        None, "Start the modules from MTP layers a checkpoint already has (to fine-tune "
        "them): `target`, the target checkpoint's own (MiMo's model.mtp_layers.*, Qwen3-Next's "
        "mtp.*), or a directory (a speculators MTP export, or a model checkpoint with such "
        "layers); they must number num_modules and fit the target's width. null: fresh "
        "modules.",
    )  # fmt: skip

    def check(self) -> None:
        if self.init_from not in (None, "target") and not Path(self.init_from).is_dir():
            raise Invalid("drafter.init_from", f"{self.init_from}: no such directory")


def new_model(target, cfg: dict) -> MTPModel:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaConfig(
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_parameters=cfg["rope_parameters"],
    )
    model = target.model
    return MTPModel(
        cfg, model.get_input_embeddings(), model.get_output_embeddings(), LlamaRotaryEmbedding(rope)
    )


class MTPDrafter(TrainableDrafter):
    """MTP modules as a drafter (see the module docstring)."""

    name = "mtp"
    config_class = MTPConfig
    shift = 1
    #: serving layouts (format -> weights file), see :mod:`specdec.drafters.mtp_layouts`
    layouts = {"speculators": "model.safetensors"}

    def __init__(self, model: MTPModel, target_layer: int, draft_ids, vocab_size: int, decay=0.8):
        self.model = model
        self.required_target_layers = (target_layer,)
        self.draft_ids = draft_ids
        self.vocab_size = vocab_size
        self.steps = model.cfg["num_modules"]
        self.decay = decay
        self.forward, self.confidence = "auto", 0.0
        self._copy = DecodingCopy()
        self.clock = Clock(model.depths[0].eh_proj.weight.device)
        self.seconds = 0.0

    # ------------------------------------------------------------------------------ building

    @classmethod
    def build(cls, target, cfg: MTPConfig, token_counts=None) -> MTPDrafter:
        """Fresh modules for ``target``, on its device."""
        draft_ids = vocabulary.draft_vocab(target, cfg.draft_vocab_size, token_counts)
        size = target.vocab_size if draft_ids is None else len(draft_ids)
        head_cfg = head_config(target, 1, 1, size, cfg.num_modules)
        head_cfg |= {"num_modules": cfg.num_modules, "own_head": draft_ids is not None}
        native = _native_modules(cfg, target) if cfg.init_from else None
        if native:  # the layers' attention has biases where the checkpoint's does
            head_cfg["attention_bias"] = "layer.q_proj.bias" in native[0]
        with torch.device("cpu"):
            model = new_model(target, head_cfg)
        _init(model, target, draft_ids, cfg.init_from_target)
        if native:
            _load_modules(model, native, cfg.init_from)
        model.to(target.device)
        layer = target.resolve_layers([LAST])[0]
        return cls(model, layer, draft_ids, target.vocab_size, cfg.step_weight_decay)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, target) -> MTPDrafter:
        """Load a checkpoint written by :meth:`save` for ``target``.

        Raises:
            ModelError: not an mtp checkpoint, or its weights or sizes do not fit.
        """
        path = Path(path)
        saved, state, draft_ids = read_head(path, cls.name, ("modules",))
        head_cfg = saved["modules"]
        check_head_fits(path, saved, head_cfg, draft_ids, target)
        with torch.device("cpu"):
            model = new_model(target, head_cfg)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ModelError(f"{path}: weights do not fit the config: {err}") from None
        model.to(target.device)
        layer = target.resolve_layers([LAST])[0]
        decay = saved.get("step_weight_decay", 0.8)
        return cls(model, layer, draft_ids, target.vocab_size, decay)

    def save(self, path: str | os.PathLike, *, target_name: str, extra: dict | None = None) -> Path:
        """Write a checkpoint directory atomically: it is complete or it does not exist."""
        config = {
            "modules": self.model.cfg,
            "target_vocab_size": self.vocab_size,
            "step_weight_decay": self.decay,
        }
        meta = {"num_modules": self.steps}
        return write_head(
            path, self, target_name=target_name, extra=extra, meta=meta, config=config
        )

    # ----------------------------------------------------------------------- serving layouts

    def export_layout(self, fmt: str, target) -> tuple[dict, dict]:
        """``(config.json, weights)`` of the modules in a serving engine's layout."""
        return mtp_layouts.export(self, fmt, target)

    @staticmethod
    def layout_keys(fmt: str, config: dict) -> set[str]:
        """The weights the layout's loader reads, from its ``config.json``."""
        return mtp_layouts.expected_keys(fmt, config)

    @classmethod
    def from_layout(cls, fmt: str, config: dict, state: dict, target) -> MTPDrafter:
        """One module back from an export (to verify it).

        Raises:
            ModelError: the export's sizes do not fit the target, or its weights its config.
        """
        layer = config["transformer_layer_config"]
        head_cfg = head_config(target, 1, 1, target.vocab_size, 1)
        head_cfg |= {"num_modules": 1, "own_head": False, "attention_bias": layer["attention_bias"]}
        mtp_layouts.check_layer_config(config, head_cfg)
        with torch.device("cpu"):
            model = new_model(target, head_cfg)
        prefix, names = mtp_layouts.SPECULATORS_PREFIX, mtp_layouts.MODULE_NAMES
        module = mtp_layouts.from_layout(state, prefix, names, emb_first=True)
        _load_modules(model, [module], f"{fmt} export")
        layer_index = target.resolve_layers([LAST])[0]
        return cls(model.to(target.device), layer_index, None, target.vocab_size)

    # ------------------------------------------------------------------------- training face

    @property
    def module(self) -> MTPModel:
        return self.model

    def prepare_training(self, config: MTPConfig, target) -> None:
        """A drafter loaded from ``drafter.from_pretrained`` takes the recipe's step weights."""
        self.decay = config.step_weight_decay

    def loaded_shape(self, config: MTPConfig, target) -> dict[str, tuple]:
        return {
            "num_modules": (config.num_modules, self.model.cfg["num_modules"]),
            "draft_vocab_size": vocab_shape(config, self.draft_ids, target),
        }

    def step_weights(self) -> torch.Tensor:
        return self.decay ** torch.arange(self.steps, dtype=torch.float32)

    # ------------------------------------------------------------------------- decoding face

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        super().configure(forward, confidence, tree)
        self.forward, self.confidence = checked_forward(forward), confidence

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        """Start a sequence with the modules that decode: the trained ones, or a copy in the
        decoding dtype (by default, on a CPU, float16 or float32, whichever is measured faster
        there: a draft step is bound by reading the weights)."""
        self.model.eval()
        weight = self.model.depths[0].eh_proj.weight
        self.decoder = self._copy.get(self.model, decoding_dtype(self.forward, self.model))
        # the kernels measured here (F.linear alone off a CPU), or the network's own forward's
        own = self.forward == "transformers"
        self.linear = torch.nn.functional.linear if own else tuned_linear(self.decoder)
        self.caches = [ModuleCache(self.decoder) for _ in self.model.depths]
        # outs[0]: the target's features of the verified positions; outs[k]: module k's outputs
        size, dtype = self.model.cfg["hidden_size"], self.decoder.dtype
        empty = torch.zeros(0, size, device=weight.device, dtype=dtype)
        self.outs = [empty] * (self.steps + 1)
        self.commit(0, target_features)

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        if not target_features:
            raise ModelError("the mtp modules need the target's last hidden state")
        for cache, out in zip(self.caches, self.outs[1:], strict=True):
            cache.length = len(out)  # the draft's entries go
        rows = target_features[self.required_target_layers[0]].to(self.decoder.dtype)
        self.outs[0] = torch.cat([self.outs[0], rows])

    @torch.inference_mode()
    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        t0 = self.clock()
        verified = len(self.outs[0])  # positions 0..L-2 of a sequence of L tokens
        if verified != len(sequence) - 1:
            raise ModelError(
                f"mtp modules out of step: features of {verified} positions for a sequence of "
                f"{len(sequence)} tokens"
            )
        ids = torch.as_tensor(list(sequence), device=self.outs[0].device)
        # module j (1-based) enters the positions i <= L-1-j whose token i + j is verified
        for j in range(1, self.steps + 1):
            start, stop = len(self.outs[j]), len(sequence) - j
            if stop > start:
                new = self.decoder.decode(
                    j - 1, self.outs[j - 1][start:stop], ids[start + j : stop + j], start,
                    self.caches[j - 1], self.linear,
                )  # fmt: skip
                self.outs[j] = torch.cat([self.outs[j], new])
        if len(sequence) < 2:
            return Proposal(ids[:0])
        model, linear, drafts = self.decoder, self.linear, {}  # drafts: module j -> its
        # outputs at the drafted positions

        def step(j: int, drafted: list[torch.Tensor]) -> torch.Tensor:
            """Module j's logits at the last verified position L - 2: it first enters the
            positions after its verified ones, whose token i + j is drafted, reading module
            j - 1's outputs there (its last verified one, then its drafted ones)."""
            start = len(self.outs[j])
            before = self.outs[j - 1][start:]
            hidden = torch.cat([before, drafts.get(j - 1, before[:0])])
            if not len(hidden):  # module 1: its last verified entry is at L - 2
                return model.logits(j - 1, self.outs[j][-1:], linear)[0]
            tokens = torch.stack(drafted[-len(hidden) :])
            drafts[j] = model.decode(j - 1, hidden, tokens, start, self.caches[j - 1], linear)
            return model.logits(j - 1, drafts[j][-1:], linear)[0]

        drafted: list[torch.Tensor] = []

        def advance(token: torch.Tensor, i: int) -> torch.Tensor:
            drafted.append(token.view(()))
            return step(i + 2, drafted)

        proposal = draft_chain(
            step(1, drafted), advance, min(k, self.steps), params, generator, self.draft_ids,
            self.vocab_size, self.confidence,
        )  # fmt: skip
        self.seconds += self.clock() - t0
        return proposal

    @property
    def draft_seconds(self) -> float:
        return self.seconds


def _native_modules(cfg: MTPConfig, target) -> list[dict]:
    """The MTP layers ``drafter.init_from`` names, under specdec's names.

    Raises:
        ModelError: the target was not loaded from a directory, the checkpoint has no MTP
            layers, or not ``num_modules`` of them.
    """
    where = cfg.init_from
    if where == "target":
        where = getattr(target.model.config, "_name_or_path", "") or ""
        if not where or not Path(where).is_dir():
            raise ModelError(
                f"drafter.init_from: target: {target.name} was not loaded from a local "
                "directory whose MTP layers could be read; name the directory instead"
            )
    layout, modules = mtp_layouts.read_native(where)
    if len(modules) != cfg.num_modules:
        raise ModelError(
            f"drafter.init_from: {where} holds {len(modules)} MTP module(s) ({layout} layout); "
            f"drafter.num_modules is {cfg.num_modules}"
        )
    return modules


@torch.no_grad()
def _load_modules(model: MTPModel, modules: list[dict], source: str) -> None:
    """Module k's weights from ``modules[k]`` (specdec's names), every weight exactly once.

    Raises:
        ModelError: weights missing, left over (a layer specdec's module has no place for,
            such as Qwen3's q_norm) or of another shape.
    """
    for k, (module, state) in enumerate(zip(model.depths, modules, strict=True)):
        try:
            module.load_state_dict(
                {n: t.to(module.eh_proj.weight.dtype) for n, t in state.items()}, strict=True
            )
        except RuntimeError as err:
            detail = " ".join(str(err).split())[:300]
            raise ModelError(f"{source}: MTP module {k} does not fit specdec's: {detail}") from None


@torch.no_grad()
def _init(model: MTPModel, target, draft_ids, from_target: bool) -> None:
    """Linear weights small and random (an own LM head: the target's rows). From the target,
    every module starts as the target's own read-out: the first module reads h = w * u (the
    target's final norm w of a unit-RMS u), so its ``hnorm`` weight is 1 / w and gives u up
    to a scalar; ``eh_proj`` passes that half through; the layer adds nothing yet (zero output
    projections); its final norm is w again, which gives back h. Later modules read the
    earlier one's output (u up to a scalar) through ``hnorm`` of weight 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    head = target.model.get_output_embeddings().weight
    if model.lm_head is not None:
        model.lm_head.weight.copy_(head[draft_ids.to(head.device)].to(model.lm_head.weight))
    norm = getattr(target.model.get_decoder(), "norm", None)
    if not from_target or norm is None or norm.weight.shape != model.depths[0].norm.weight.shape:
        return
    size, w = model.cfg["hidden_size"], norm.weight.detach().float().cpu()
    for k, module in enumerate(model.depths):
        module.eh_proj.weight.zero_()
        module.eh_proj.weight[:, :size] = torch.eye(size)
        module.layer.o_proj.weight.zero_()
        module.layer.down_proj.weight.zero_()
        module.norm.weight.copy_(w)
        if k == 0:
            module.hnorm.weight.copy_(torch.where(w.abs() > 1e-6, 1 / w, torch.zeros_like(w)))
