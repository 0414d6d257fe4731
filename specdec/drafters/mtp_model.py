"""Multi-token-prediction modules as a module (DeepSeek-V3, DeepSeek-AI 2024, sec. 2.2).

Module k (k = 1..D) at position i reads the previous depth's representation ``h^{k-1}_i``
(depth 0: the target's last hidden state) and the embedding of token i + k, both RMS-normed,
projects their concatenation back to H (``eh_proj``), runs one transformer layer over the
sequence (causal), and predicts token i + k + 1 through its own final norm and the LM head
shared by all modules (the target's, frozen, or a reduced one of the drafter's own):

    h'^k_i = eh_proj([hnorm(h^{k-1}_i); enorm(emb(t_{i+k}))]);  h^k = layer_k(h'^k)
    p^k_{i+k+1} = softmax(head(norm_k(h^k_i)))

Training runs the D modules over whole sequences at once, each on the true tokens (teacher
forcing, as in the paper). Decoding keeps, per module, a KV cache of the positions whose inputs
are all verified, and drafts token j of a chain with module j at the last verified position
(its entries after the verified ones read drafted tokens): the same computation as training
on a sequence that continues with the draft.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.eagle3_model import DraftLayer, RMSNorm


class MTPModule(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj``, one decoder layer and a final norm."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DraftLayer(cfg, first=False)
        self.norm = RMSNorm(h, eps)

    def forward(
        self, hidden, embeds, cos, sin, mask, cache: ModuleCache | None = None, start=0,
        linear=F.linear,
    ):  # fmt: skip
        """``(h^k, norm(h^k))`` over positions with ``cos``/``sin`` under ``mask``: from the
        previous depth's ``hidden`` and the ``embeds`` of the tokens k ahead; with a
        ``cache``, the positions' keys and values go to its slots ``start..`` and the
        attention reads every slot before them too; ``linear``: the matrix product to use
        (``F.linear`` or a faster equivalent). (One ``forward``, so that a sharded module
        gathers its weights once around all of it.)"""
        x = torch.cat([self.hnorm(hidden), self.enorm(embeds.to(hidden.dtype))], dim=-1)
        x = linear(x, self.eh_proj.weight)
        layer = self.layer
        q, k, v = layer.qkv(x, None, cos, sin, linear)
        if cache is not None:  # [kv_heads, slots, dim] each
            end = start + x.shape[-2]
            cache.reserve(end)
            cache.keys[:, start:end], cache.values[:, start:end] = k, v
            k, v, cache.length = cache.keys[:, :end], cache.values[:, :end], end
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=layer.heads != layer.kv_heads
        )
        x = layer.finish(x, attn, linear)
        return x, self.norm(x)


class MTPModel(nn.Module):
    """The trainable modules. The target's embedding and (with the full vocabulary) its LM
    head are borrowed: neither trained nor saved.

    Args:
        cfg: ``hidden_size``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate_size``,
            ``rms_norm_eps``, ``attention_bias`` (the layer's, as the target's),
            ``num_modules``, ``draft_vocab_size``, ``own_head``.
        embedding: the target's input embedding module.
        target_head: the target's output embedding module.
        rotary: a transformers rotary-embedding module for the target's positions.
    """

    def __init__(self, cfg: dict, embedding: nn.Module, target_head: nn.Module, rotary):
        super().__init__()
        self.cfg = dict(cfg)
        self.depths = nn.ModuleList(MTPModule(cfg) for _ in range(cfg["num_modules"]))
        self.lm_head = None
        if cfg["own_head"]:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["draft_vocab_size"], bias=False)
        self.rotary = rotary
        self._borrowed = (embedding, target_head)  # a tuple: nn.Module does not register it

    @property
    def embedding(self) -> nn.Module:
        return self._borrowed[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.depths[0].eh_proj.weight.dtype

    @property
    def borrowed_head(self) -> nn.Module | None:
        """The target's LM head where the modules read out through it (not a submodule)."""
        return self._borrowed[1] if self.lm_head is None else None

    def read_out(self, normed: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """Logits from a module's normed output, through the shared LM head."""
        if self.lm_head is not None:
            return linear(normed, self.lm_head.weight)
        return linear(normed, self._borrowed[1].weight.detach().to(normed.dtype))

    def rope(self, positions: torch.Tensor):
        """cos, sin ``[T, dim]`` at ``positions`` ``[T]``."""
        probe = self.depths[0].eh_proj.weight[:1, :1]
        cos, sin = self.rotary(probe, positions.view(1, -1))
        return cos[0].to(probe.dtype), sin[0].to(probe.dtype)

    def forward(
        self, input_ids, attention_mask, features: list[torch.Tensor], at=None
    ) -> torch.Tensor:
        """``[D, B, T, V]``: module k at row t predicts token t + k + 1 (k = 1..D).

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, T]`` padding mask (1 = real token), or None.
            features: ``[h]``, the target's last hidden state ``[B, T, H]``.
            at: ``[B, T]`` booleans, the rows whose logits are read, or None (every row).
                The modules run at every row (a module's keys are every row's); the shared
                LM head only at those: ``[D, N, V]``, in ``x[at]``'s order.
        """
        hidden = features[0].to(self.dtype)
        B, T = input_ids.shape
        embeds = self.embedding(input_ids).detach()  # [B, T, H]
        causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
        if attention_mask is not None:
            causal = causal & attention_mask.bool()[:, None, None, :]
        cos, sin = self.rope(torch.arange(T, device=hidden.device))
        out = []
        for k, module in enumerate(self.depths, start=1):
            pad = embeds.new_zeros(B, min(k, T), embeds.shape[-1])
            e = torch.cat([embeds[:, k:], pad], dim=1)  # row t: the token t + k
            hidden, normed = module(hidden, e, cos, sin, causal)
            out.append(self.read_out(normed if at is None else normed[at]))
        return torch.stack(out)

    @torch.inference_mode()
    def decode(
        self, depth: int, hidden, tokens, start: int, cache: ModuleCache, linear=F.linear
    ) -> torch.Tensor:
        """Module ``depth`` (0-based) over ``m`` positions ``start..start+m-1``, appended to its
        cache: ``hidden`` ``[m, H]`` the previous depth's outputs there, ``tokens`` ``[m]`` the
        token ``depth + 1`` after each. Returns the module's outputs ``[m, H]`` (pre-norm)."""
        module, m = self.depths[depth], hidden.shape[0]
        end = start + m
        cache.reserve(end)
        cos, sin = cache.cos[start:end], cache.sin[start:end]
        mask = None
        if m > 1:
            mask = torch.ones(m, end, dtype=torch.bool, device=hidden.device).tril(start)
        embeds = self.embedding(tokens)
        x, _ = module(hidden.to(self.dtype), embeds, cos, sin, mask, cache, start, linear)
        return x

    @torch.inference_mode()
    def logits(self, depth: int, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        return self.read_out(self.depths[depth].norm(x), linear).float()

    def converted(self, dtype: torch.dtype) -> MTPModel:
        """A copy in ``dtype`` for decoding: the modules, and the target's LM head where they
        read out through it (converted once here, not at every draft step); the rotary module
        stays in float32 (the tables it gives are cast to ``dtype``) and the target's
        embedding stays borrowed."""
        head = self._borrowed[1]
        if self.lm_head is None:  # a module holding the converted weight, as the head's
            head = nn.Embedding.from_pretrained(head.weight.detach().to(dtype), freeze=True)
        copy = MTPModel(self.cfg, self.embedding, head, nn.Identity())
        copy.load_state_dict(self.state_dict())
        copy.to(self.depths[0].eh_proj.weight.device, dtype)
        copy.rotary = self.rotary  # shared, in float32
        return copy.eval()


class ModuleCache:
    """One module's KV cache for one sequence (``[kv_heads, capacity, dim]`` keys and values,
    and the rotary tables of its slots); rolling back is setting ``length``."""

    def __init__(self, model: MTPModel, capacity: int = 512):
        self.model, self.cfg = model, model.cfg
        self.device, self.dtype = model.depths[0].eh_proj.weight.device, model.dtype
        self.capacity, self.length = 0, 0
        self.keys = self.values = None
        self.reserve(capacity)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        shape = (self.cfg["kv_heads"], capacity, self.cfg["head_dim"])
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.keys is not None:
            keys[:, : self.length] = self.keys[:, : self.length]
            values[:, : self.length] = self.values[:, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity
        self.cos, self.sin = self.model.rope(torch.arange(capacity, device=self.device))
