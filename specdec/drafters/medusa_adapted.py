"""Medusa-2 (Cai et al. 2024, sec. 2.3): the heads trained jointly with LoRA adapters on the
target's backbone, through peft.

The adapted backbone is a shallow copy of the target: its modules are new, its weights are the
target's own tensors (nothing is duplicated), and peft wraps the copy's projections with
adapters (B starts at zero, so the adapted backbone starts as the target). The target itself
is never touched: it stays the teacher. Training (:class:`AdaptedHeads`) runs the adapted
backbone with gradients through the adapters and returns K + 1 steps: step 0 is the backbone's
own next-token distribution, pulled to the original target's by self-distillation, steps
1..K the heads on the backbone's last hidden state.

The output of decoding is the adapted backbone's, not the original target's: proposals are
verified by a copy of the target with the adapters merged into the adapted weights
(:func:`merged_copy`; only those weights are new tensors).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

ADAPTER_DIR = "adapter"


def shallow_copy(model: nn.Module, keep: set[str] = frozenset()) -> nn.Module:
    """A copy of ``model`` with new modules that share every weight tensor except those named
    in ``keep`` (which are copied)."""
    memo = {id(p): p for name, p in model.named_parameters() if name not in keep}
    return copy.deepcopy(model, memo)


def adapt(target_model: nn.Module, rank: int, alpha: float, modules: list[str]):
    """A peft LoRA model over a shallow copy of the target (adapters only trainable)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules), lora_dropout=0.0)
    return get_peft_model(shallow_copy(target_model), config)


def checkpoint_layers(backbone) -> None:
    """Recompute each of the adapted backbone's decoder layers in the backward pass instead of
    keeping its activations (transformers' activation checkpointing, non-reentrant).
    transformers checkpoints a layer only in training mode: the layers' own
    flag is set, their children (attention, MLP, any dropout) stay in eval mode, so the
    computation is unchanged. The backbone is a copy: the target's layers are not touched."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = backbone.get_base_model()
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.training = True


def lora_settings(backbone) -> dict:
    config = backbone.peft_config["default"]
    return {
        "rank": config.r,
        "alpha": config.lora_alpha,
        "target_modules": sorted(config.target_modules),
    }


class AdaptedHeads(nn.Module):
    """The trainable module of Medusa-2: the heads and the adapters (registered here, so the
    optimizer, DDP and the saved state see them); the backbone itself is borrowed.

    ``forward`` returns ``[K + 1, B, T, V]``: the adapted backbone's logits, then the heads';
    with heads over a reduced vocabulary of D tokens, the list of those K + 1 tensors (the
    backbone's ``[B, T, V]``, the heads' ``[B, T, D]``).
    """

    def __init__(self, heads: nn.Module, backbone):
        super().__init__()
        self.heads = heads
        trainable = {n: p for n, p in backbone.named_parameters() if p.requires_grad}
        self.adapters = nn.ParameterDict({n.replace(".", "__"): p for n, p in trainable.items()})
        self._borrowed = (backbone,)

    @property
    def backbone(self):
        return self._borrowed[0]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The adapters: under FSDP they stay whole on every process (they live inside the
        borrowed backbone, which runs them), while the heads are sharded."""
        return list(self.adapters.values())

    def param_groups(self, params: list, adapter_lr: float) -> list[dict]:
        """The optimizer's groups over ``params``: the heads at the run's rate, the adapters
        at ``adapter_lr``."""
        adapters = {id(p) for p in self.adapters.values()}
        return [
            {"params": [p for p in params if id(p) not in adapters]},
            {"params": [p for p in params if id(p) in adapters], "lr": adapter_lr},
        ]

    def forward(self, input_ids, attention_mask, features=None, at=None) -> torch.Tensor:
        backbone = self.backbone
        probe = next(backbone.buffers(), None)
        if probe is not None and probe.device != input_ids.device:  # the target moved since
            backbone.to(input_ids.device)
        out = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        heads = self.heads(None, None, [out.hidden_states[-1]], at=at)
        own = (out.logits if at is None else out.logits[at]).to(heads.dtype)
        if heads.shape[-1] != own.shape[-1]:
            return [own, *heads]
        return torch.cat([own[None], heads])


@torch.no_grad()
def merged_copy(target_model: nn.Module, backbone) -> nn.Module:
    """The target with the adapters merged into new tensors of the adapted weights (the target
    and the backbone are left as they are)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in backbone.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            deltas[name.removeprefix("base_model.model.") + ".weight"] = module.get_delta_weight(
                "default"
            )
    merged = shallow_copy(target_model, keep=set(deltas))
    params = dict(merged.named_parameters())
    for name, delta in deltas.items():
        params[name].add_(delta.to(params[name].dtype))
    return merged.eval()


def save_adapter(backbone, path: Path) -> None:
    """The adapters in peft's own layout (``adapter/``: loadable with ``PeftModel``)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    path.mkdir()
    state = get_peft_model_state_dict(backbone)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, path / "adapter_model.safetensors")
    config = backbone.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def load_adapter(target_model: nn.Module, path: Path):
    """An adapted backbone over ``target_model`` with the adapters saved at ``path``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    backbone = adapt(target_model, config["r"], config["lora_alpha"], config["target_modules"])
    result = set_peft_model_state_dict(backbone, load_file(path / "adapter_model.safetensors"))
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter weights that fit no adapter: {result.unexpected_keys[:4]}")
    return backbone


@torch.no_grad()
def save_merged(target, backbone, path: Path) -> Path:
    """The adapted backbone with its adapters merged, saved as a transformers checkpoint (with
    the target's tokenizer) at ``path`` and reloaded to check its logits.

    Raises:
        ModelError: the reload's logits differ from the merged model's.
    """
    from transformers import AutoModelForCausalLM

    from specdec.errors import ModelError

    merged = merged_copy(target.model, backbone)
    merged.save_pretrained(path, safe_serialization=True)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(path)
    dtype = next(merged.parameters()).dtype
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(target.device).eval()
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(target.device)
    if not torch.allclose(reloaded(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-4):
        raise ModelError(f"{path}: the reloaded adapted backbone's logits differ from specdec's")
    return path
