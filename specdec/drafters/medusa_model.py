"""The Medusa heads' network (Cai et al. 2024): K heads on one hidden state, each
``num_layers`` residual blocks ``x + SiLU(W x + b)`` and an LM head (an own one over a reduced
vocabulary, or the target's, borrowed). The drafter around it is :mod:`specdec.drafters.medusa`.
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``, started at zero (the identity)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The trainable heads. The target's LM head, when used, is borrowed (not a submodule).

    Args:
        cfg: ``num_heads``, ``num_layers``, ``hidden_size``, ``draft_vocab_size`` and
            ``own_head`` (an LM head of their own).
        target_head: the target's output embedding module.
    """

    def __init__(self, cfg: dict, target_head: nn.Module):
        super().__init__()
        self.cfg = dict(cfg)
        hidden = cfg["hidden_size"]
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(cfg["num_layers"])])
            for _ in range(cfg["num_heads"])
        )
        self.lm_head = None
        if cfg["own_head"]:
            self.lm_head = nn.Linear(hidden, cfg["draft_vocab_size"], bias=False)
        self._borrowed = (target_head,)  # a tuple: nn.Module does not register what is inside

    @property
    def borrowed_head(self) -> nn.Module | None:
        """The target's LM head where the heads read out through it (not a submodule)."""
        return self._borrowed[0] if self.lm_head is None else None

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(x)
        weight = self._borrowed[0].weight.detach()
        return nn.functional.linear(x, weight.to(x.dtype))

    def forward(
        self, input_ids, attention_mask, features: list[torch.Tensor], at=None
    ) -> torch.Tensor:
        """``[S, B, T, D]``: head s at row t, from the target's last hidden state at t; with
        ``at`` (``[B, T]`` booleans) ``[S, N, D]`` at those N rows only, in ``x[at]``'s order."""
        h = features[0].to(self.blocks[0][0].linear.weight.dtype)
        if at is None:
            return torch.stack([self.read_out(block(h)) for block in self.blocks])
        h = h[at]
        return torch.stack([self.read_out(block(h)) for block in self.blocks])

    @torch.inference_mode()
    def heads(self, h: torch.Tensor) -> torch.Tensor:
        """``[K, D]`` every head's logits from one ``[H]`` hidden state."""
        return self.forward(None, None, [h.view(1, -1)])[:, 0].float()

    @torch.inference_mode()
    def head(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """``[D]`` head i's logits from one ``[H]`` hidden state (a chain asks for one at a
        time, and stops asking once its drafts are unlikely)."""
        x = h.view(1, -1).to(self.blocks[0][0].linear.weight.dtype)
        return self.read_out(self.blocks[i](x))[0].float()

    def converted(self, dtype: torch.dtype) -> MedusaHeads:
        """A copy in ``dtype`` for decoding; the target's LM head, where the heads read out
        through it, converted once here instead of at every draft."""
        head = self._borrowed[0]
        if self.lm_head is None:
            head = nn.Embedding.from_pretrained(head.weight.detach().to(dtype), freeze=True)
        copy = MedusaHeads(self.cfg, head)
        copy.load_state_dict(self.state_dict())
        return copy.to(self.blocks[0][0].linear.weight.device, dtype).eval()
