"""The EAGLE-3 draft head as a module: fused target features + next-token embedding, one
(or more) decoder layers, a norm and an LM head over the draft vocabulary.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test". Notation, for a target with hidden size H:

- ``g_t = fc([h^low_t; h^mid_t; h^high_t])``: the target's hidden states of three layers at
  position t, fused to H;
- the first layer reads ``[norm(e_{t+1}); norm(g_t)]`` (2H wide: the embedding of the token
  after t, from the target's frozen embedding) with ``g_t`` as its residual stream; its output
  ``a_t`` predicts token t + 2 through ``lm_head(norm(a_t))``;
- a further draft step replaces ``g`` by the head's own output: at position t + 1 it reads
  ``[norm(e_{t+2}); norm(a_t)]``, and so on.

Training-time test unrolls S such steps over a whole sequence at once. Step s at row t sits at
position t + s, and attends to the step-0 keys of rows <= t and to its own earlier steps' keys
at row t: exactly what the same head sees while decoding, where step s's entry at position
t + s follows the step-0 entries of the verified prefix in the KV cache
(:meth:`Eagle3Model.forward` and :meth:`Eagle3Model.decode` compute the same numbers; a test
checks it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specdec.decoding.session import full_mask


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalised in float32, scaled by the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class DraftLayer(nn.Module):
    """A pre-norm decoder layer (GQA attention with rotary embeddings, gated SiLU MLP). The
    first layer of the head reads the embedding and the hidden state side by side (2H)."""

    #: the methods the head calls instead of ``forward`` (a sharded layer gathers its weights
    #: around each)
    sharded_methods = ("qkv", "finish")

    def __init__(self, cfg: dict, first: bool):
        super().__init__()
        h, heads, kv, dim = cfg["hidden_size"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        self.first, self.heads, self.kv_heads, self.head_dim = first, heads, kv, dim
        eps, bias = cfg["rms_norm_eps"], cfg["attention_bias"]
        if first:
            self.embed_norm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        else:
            self.input_norm = RMSNorm(h, eps)
        width = 2 * h if first else h
        self.q_proj = nn.Linear(width, heads * dim, bias=bias)
        self.k_proj = nn.Linear(width, kv * dim, bias=bias)
        self.v_proj = nn.Linear(width, kv * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], h, bias=False)

    def qkv(self, x, embeds, cos, sin, linear=F.linear):
        """Queries, keys and values ``[..., heads, T, dim]`` of positions with ``cos``/``sin``."""
        if self.first:
            h = torch.cat([self.embed_norm(embeds), self.hidden_norm(x)], dim=-1)
        else:
            h = self.input_norm(x)
        lead = h.shape[:-1]

        def project(module, n):
            y = linear(h, module.weight, module.bias).view(*lead, n, self.head_dim)
            return y.transpose(-2, -3)  # [..., n, T, dim]

        q, k = project(self.q_proj, self.heads), project(self.k_proj, self.kv_heads)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), project(self.v_proj, self.kv_heads)

    def finish(self, x, attn, linear=F.linear):
        """Residual add of the attention output ``[..., heads, T, dim]``, then the MLP."""
        attn = attn.transpose(-2, -3).flatten(-2)
        x = x + linear(attn, self.o_proj.weight)
        h = self.post_norm(x)
        gate = F.silu(linear(h, self.gate_proj.weight)) * linear(h, self.up_proj.weight)
        return x + linear(gate, self.down_proj.weight)


class Eagle3Model(nn.Module):
    """The trainable EAGLE-3 head. The target's embedding is borrowed (not a submodule: it is
    neither trained nor saved).

    Args:
        cfg: sizes (``hidden_size``, ``target_hidden_size``, ``num_features``, ``heads``,
            ``kv_heads``, ``head_dim``, ``intermediate_size``, ``num_layers``,
            ``rms_norm_eps``, ``attention_bias``, ``draft_vocab_size``, ``steps``).
        embedding: the target's input embedding module.
        rotary: a transformers rotary-embedding module for the target's positions.
    """

    def __init__(self, cfg: dict, embedding: nn.Module, rotary: nn.Module):
        super().__init__()
        self.cfg = dict(cfg)
        h = cfg["hidden_size"]
        self.fc = nn.Linear(cfg["num_features"] * cfg["target_hidden_size"], h, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg, i == 0) for i in range(cfg["num_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.rotary = rotary
        self._borrowed = (embedding,)  # a tuple: nn.Module does not register what is inside
        self.feature_noise = 0.0
        self.recompute_attention = False  # training: attention weights recomputed, not kept

    @property
    def embedding(self) -> nn.Module:
        return self._borrowed[0]

    def fuse(self, features: list[torch.Tensor]) -> torch.Tensor:
        """``g = fc([h_1; ...; h_n])`` from the target layers' outputs ``[..., Ht]``."""
        x = torch.cat(features, dim=-1).to(self.fc.weight.dtype)
        return self.fc(x)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin ``[T, dim]`` at ``positions`` ``[T]``."""
        probe = self.fc.weight[:1, :1].to(dtype)
        cos, sin = self.rotary(probe, positions.view(1, -1))
        return cos[0].to(dtype), sin[0].to(dtype)

    def forward(
        self, input_ids, attention_mask, features: list[torch.Tensor], at=None
    ) -> torch.Tensor:
        """Training-time test over whole sequences.

        Args:
            input_ids: ``[B, T]`` token ids.
            attention_mask: ``[B, T]`` padding mask (1 = real token), or None.
            features: the target's fused layers' outputs, each ``[B, T, Ht]``.
            at: ``[B, T]`` booleans, the rows whose logits are read (where a step trains), or
                None: every row. Only those rows' logits are returned; at the others only the
                keys and attention are computed (on step 0, every layer but the last runs there in
                full: the next layer's keys read them); their output projection, MLP and LM
                head are skipped. A row's later steps attend only to step 0's keys and to the
                row's own earlier steps, so no read row depends on what is skipped.

        Returns:
            ``[S, B, T, D]`` logits (``[S, N, D]`` at the N rows ``at`` sets, in ``x[at]``'s
            order); step s at row t predicts token t + 2 + s.
        """
        hidden = self.fuse(features)  # [B, T, H]
        if self.training and self.feature_noise > 0:
            hidden = hidden + self.feature_noise * hidden.detach().std() * torch.randn_like(hidden)
        B, T = input_ids.shape
        embeds = self.embedding(input_ids).to(hidden.dtype).detach()  # [B, T, H]
        causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
        if attention_mask is not None:  # a padded row sees itself only (never all -inf: NaN)
            eye = torch.eye(T, dtype=torch.bool, device=hidden.device)
            causal = (causal & attention_mask.bool()[:, None, None, :]) | eye
        caches: list[list] = [[] for _ in self.layers]
        positions = torch.arange(T, device=hidden.device)
        rows = None if at is None else at.nonzero(as_tuple=True)  # (b, t) of the read rows
        out = []
        for s in range(self.cfg["steps"]):
            pad = embeds.new_zeros(B, min(1 + s, T), embeds.shape[-1])
            e = torch.cat([embeds[:, 1 + s :], pad], dim=1)  # row t: the token t + 1 + s
            cos, sin = self.rope(positions + s, hidden.dtype)
            x = hidden
            for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
                q, k, v = layer.qkv(x, e, cos, sin)
                cache.append((k, v))
                if self.training and self.recompute_attention:
                    # the steps so far as they are now: the list grows with later steps
                    attn = checkpoint(_ttt_attention, q, tuple(cache), causal, use_reentrant=False)
                else:
                    attn = _ttt_attention(q, cache, causal)
                if rows is None or (s == 0 and i < len(self.layers) - 1):
                    x = layer.finish(x, attn)  # every row (the next layer's step-0 keys)
                else:  # the read rows only; the others keep their input
                    b, t = rows
                    x = x.index_put(rows, layer.finish(x[b, t], attn[b, :, t].transpose(0, 1)))
            hidden = x
            if rows is None:
                out.append(self.lm_head(self.norm(x)))
            else:
                out.append(self.lm_head(self.norm(x[rows])))
        return torch.stack(out)

    def decode(
        self,
        embeds,
        hidden,
        start: int,
        cache: DraftCache,
        linear=F.linear,
        positions=None,
        mask=None,
    ):
        """Append ``m`` entries at cache slots ``start..start+m-1`` to ``cache`` and return the
        head's outputs ``[m, H]`` (pre-norm: the next step's hidden state).

        Args:
            embeds: ``[m, H]`` embeddings of the tokens after each position.
            hidden: ``[m, H]`` fused target features (step 0) or the head's own outputs.
            start: slot of the first entry; entries at and after it are overwritten.
            cache: the head's KV cache.
            linear: the matrix product to use (``F.linear`` or a faster equivalent).
            positions: ``[m]`` the entries' positions; None: their slots (a chain).
            mask: ``[m, w]`` booleans over the last w entries (the earlier ones visible),
                True where an entry may attend (a draft tree); None: causal.
        """
        m, end = hidden.shape[0], start + hidden.shape[0]
        cache.reserve(end if positions is None else max(end, int(positions.max()) + 1))
        embeds = embeds.to(hidden.dtype)
        if positions is None:
            cos, sin = cache.cos[start:end], cache.sin[start:end]
        else:
            positions = positions.to(hidden.device)
            cos, sin = cache.cos[positions], cache.sin[positions]
        if mask is not None:
            mask = full_mask(mask, end, hidden.device)
        elif m > 1:
            mask = torch.ones(m, end, dtype=torch.bool, device=hidden.device).tril(start)
        x = hidden
        for layer, (keys, values) in zip(self.layers, cache.kv, strict=True):
            q, k, v = layer.qkv(x, embeds, cos, sin, linear)
            keys[:, start:end], values[:, start:end] = k, v
            attn = F.scaled_dot_product_attention(
                q, keys[:, :end], values[:, :end], attn_mask=mask,
                enable_gqa=layer.heads != layer.kv_heads,
            )  # fmt: skip
            x = layer.finish(x, attn, linear)
        cache.length = end
        return x

    def logits(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        return linear(self.norm(x), self.lm_head.weight)

    def converted(self, dtype: torch.dtype) -> Eagle3Model:
        """A copy in ``dtype`` for decoding (the rotary module stays in float32, the tables it
        gives are cast to ``dtype``; the target's embedding stays borrowed)."""
        copy = Eagle3Model(self.cfg, self.embedding, nn.Identity())
        copy.load_state_dict(self.state_dict())
        copy.to(self.fc.weight.device, dtype)
        copy.rotary = self.rotary  # shared, in float32
        return copy.eval()


class DraftCache:
    """The head's KV cache for one sequence: ``kv[layer] = (keys, values)``, each
    ``[kv_heads, capacity, dim]``; rolling back is setting ``length``."""

    def __init__(self, model: Eagle3Model, dtype: torch.dtype, capacity: int = 1024):
        self.model, self.dtype, self.capacity, self.length = model, dtype, 0, 0
        self.kv: list = []
        self.reserve(capacity)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cfg, device = self.model.cfg, self.model.fc.weight.device
        capacity = max(needed, 2 * self.capacity)
        shape = (cfg["kv_heads"], capacity, cfg["head_dim"])
        kv = [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in self.model.layers
        ]
        for (k, v), (old_k, old_v) in zip(kv, self.kv, strict=False):
            k[:, : self.length] = old_k[:, : self.length]
            v[:, : self.length] = old_v[:, : self.length]
        self.kv, self.capacity = kv, capacity
        self.cos, self.sin = self.model.rope(torch.arange(capacity, device=device), self.dtype)


def _ttt_attention(q: torch.Tensor, cache: list, causal: torch.Tensor) -> torch.Tensor:
    """Attention of step s = len(cache) - 1: causal over step 0's keys, plus the same row's
    keys of steps 1..s.

    Args:
        q: ``[B, heads, T, dim]``.
        cache: ``[(k, v)]`` per step so far, each ``[B, kv_heads, T, dim]``.
        causal: ``[T, T]`` or ``[B, 1, T, T]`` boolean mask over step 0's keys.

    Returns:
        ``[B, heads, T, dim]``.
    """
    groups = q.shape[1] // cache[0][0].shape[1]
    keys = [k.repeat_interleave(groups, dim=1) for k, _ in cache]
    values = [v.repeat_interleave(groups, dim=1) for _, v in cache]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
    scores = scores.masked_fill(~causal, float("-inf"))
    diagonal = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, h, T, 1] each
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    T = scores.shape[-1]
    out = weights[..., :T] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + weights[..., T + j : T + j + 1] * v
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., heads, T, dim]`` (halves rotated, as in Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------- building


def head_config(target, num_features: int, num_layers: int, vocab: int, steps: int) -> dict:
    text = target.config.get_text_config()
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "target_hidden_size": text.hidden_size,
        "num_features": num_features,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate_size": text.intermediate_size,
        "num_layers": num_layers,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "attention_bias": bool(getattr(text, "attention_bias", False)),
        "draft_vocab_size": vocab,
        "steps": steps,
        "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
        "rope_parameters": rope_parameters(text),
    }


def rope_parameters(text) -> dict:
    """The target's rotary settings (of its full-attention layers where they differ)."""
    params = getattr(text, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(text, "rope_theta", 10000.0)}
    return dict(params)


def new_model(target, cfg: dict) -> Eagle3Model:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaConfig(
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_parameters=cfg["rope_parameters"],
    )
    with torch.device("cpu"):
        model = Eagle3Model(cfg, target.model.get_input_embeddings(), LlamaRotaryEmbedding(rope))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    return model


#: a fixed text whose hidden states set the scale of the fused features at initialisation
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "Speculative decoding drafts tokens with a small model and verifies them at once."
)


@torch.no_grad()
def init_from_target(model: Eagle3Model, target, draft_ids, high_layer: int) -> None:
    """Start where the target's own read-out is: the fused features are the highest target
    layer's scaled to unit RMS, the decoder layers add nothing yet (zero output projections),
    and the final norm and LM head are the target's. The head then predicts what the target's
    logit lens on that layer predicts, a far better start than a confident random guess.

    The scale matters: a late layer's residual stream is large (SmolLM2-135M's layer 26 has an
    RMS near 19), and Adam moves each weight by about the learning rate per step, so on the
    raw scale the decoder layer would need hundreds of steps before its output counts. The RMS
    is measured on a fixed probe text, leaving out the first position (an attention sink)."""
    fc, size = model.fc.weight, model.cfg["hidden_size"]
    if model.cfg["target_hidden_size"] == size:
        ids = target.tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
        states = target.forward(ids, hidden_layers=[high_layer]).hidden_states[high_layer]
        rms = states[0, 1:].float().pow(2).mean().sqrt().clamp_min(1e-6)
        fc.zero_()
        fc[:, -size:] = torch.eye(size, dtype=fc.dtype) / rms.to(fc.device)
    for layer in model.layers:
        layer.o_proj.weight.zero_()
        layer.down_proj.weight.zero_()
    head = target.model.get_output_embeddings().weight.to(fc.device)
    model.lm_head.weight.copy_(head if draft_ids is None else head[draft_ids.to(head.device)])
    norm = getattr(target.model.get_decoder(), "norm", None)
    if norm is not None and norm.weight.shape == model.norm.weight.shape:
        model.norm.weight.copy_(norm.weight)
