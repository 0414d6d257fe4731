"""A lean decoding forward for Llama-family models: the drafter's inner loop and the target's.

A decoding step of a small model is dominated by per-call framework work and by how the weights
are read, not by arithmetic: on two CPU cores a 2-layer SmolLM2-sized draft spends most of its
~6 ms in module dispatch, mask construction and cache bookkeeping. :class:`CompactSession` runs
the same computation (RMSNorm, rotary embedding, grouped-query attention, gated MLP, LM head)
from the model's weights with a preallocated KV cache, so rolling back is moving an index. It
follows a model that is still being trained (see :meth:`CompactSession.reset`).

On a CPU in float32 the matrix products of one or two new tokens are computed as ``W @ x.T``:
MKL (torch 2.13) serves a 1-row ``F.linear`` with a matrix-vector kernel that reads SmolLM2-135M's
30 layers and head in 45 ms, while ``W @ x.T`` with two rows takes 16 ms, so one new token is
computed as two identical rows. From three rows on (a verify of two or more drafted tokens, a
draft tree, a prompt) that layout turns slow (a forward of 3, 5 and 9 new tokens costs 1.4, 1.6
and 2.6 forwards of one), so there the session multiplies by a copy of each weight that oneDNN
has reordered for small batches once (``packed``), which costs about the same from 3 to 6 rows
(1.2-1.3 forwards of one token, 1.5 at 9). The copies are made when a session starts and take
as much memory again as the linear weights (SmolLM2-135M: 0.3 s, peak RSS about 1 GiB more).
These costs were measured on two cores of an x86-64 CPU with AVX-512 (AMD EPYC); on another
CPU, run the benchmark before relying on them. In float16 ``F.linear`` is the fastest and is
kept (``bench/compact_forward.py`` prints all three).

Only architectures whose decoder layer is exactly that computation are accepted
(:func:`supports`); anything else keeps the general :class:`ModelSession`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.decoding.session import ModelSession, full_mask, moved_tail
from specdec.errors import ConfigError
from specdec.layers import resolve_layer

#: model types whose decoder layer is pre-norm attention + gated MLP with standard rotary
#: embeddings (Qwen3 adds a per-head RMSNorm on queries and keys)
COMPACT_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def supports(model) -> bool:
    """Whether :class:`CompactSession` computes exactly what ``model`` computes."""
    config = model.config.get_text_config()
    if config.model_type not in COMPACT_MODEL_TYPES or config.hidden_act != "silu":
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) > 1:
        return False
    decoder = getattr(model, "model", None)
    return all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb"))


#: how the target runs while decoding: auto is the compact forward on a CPU where the
#: architecture has one (where it was measured), the transformers forward elsewhere
TARGET_FORWARDS = ("auto", "compact", "transformers")


def target_session(model, forward: str = "auto", hidden_layers: Sequence[int] = ()) -> ModelSession:
    """The target's session for decoding (plain and speculative alike).

    The compact forward runs in the target's own dtype on its own weights: the same function,
    so exactness is untouched; only the kernels and the bookkeeping differ.

    Raises:
        ConfigError: an unknown choice, or ``compact`` for an unsupported architecture.
    """
    if forward not in TARGET_FORWARDS:
        raise ConfigError(f"target forward: expected one of {TARGET_FORWARDS}, got {forward!r}")
    if forward == "compact" and not supports(model):
        raise ConfigError(
            f"target forward 'compact': {type(model).__name__} has no compact forward "
            f"(supported: {', '.join(COMPACT_MODEL_TYPES)}); use 'transformers' or 'auto'"
        )
    weight = model.get_input_embeddings().weight
    auto = supports(model) and weight.device.type == "cpu"
    if forward == "transformers" or (forward == "auto" and not auto):
        return ModelSession(model, hidden_layers=hidden_layers)
    dtype = weight.dtype
    return CompactSession(model, dtype=dtype, hidden_layers=hidden_layers)


def _linear_transposed(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` as ``weight @ x.T`` (a single row is doubled to stay off the matrix-vector
    kernel); the result is made contiguous so the next product sees the same layout."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = rows.expand(2, -1).contiguous()
    y = weight @ rows.t()
    y = (y[:, :1] if single else y).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


#: the fewest rows the ``packed`` layout multiplies with its reordered weights (fewer: ``W @ x.T``)
PACKED_FROM_ROWS = 3
#: the batch size oneDNN reorders the weights for
PACKED_FOR_ROWS = 4


def packing_available() -> bool:
    """Whether this torch has oneDNN's reordered-weight linear (CPU builds with MKL-DNN)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def _linear_packed(x: torch.Tensor, weight: torch.Tensor, bias=None, packed=None) -> torch.Tensor:
    """``F.linear`` through ``packed`` (``weight`` reordered by oneDNN) from
    :data:`PACKED_FROM_ROWS` rows on, as :func:`_linear_transposed` below that."""
    rows = x.reshape(-1, x.shape[-1])
    if packed is None or rows.shape[0] < PACKED_FROM_ROWS:
        return _linear_transposed(x, weight, bias)
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


#: how a session computes a linear layer: ``linear`` (``F.linear``), ``transposed``
#: (``W @ x.T``) or ``packed`` (``W @ x.T`` for one or two rows, oneDNN's reordered weights
#: from three)
LAYOUTS = {"linear": F.linear, "transposed": _linear_transposed, "packed": _linear_packed}


def default_layout(device: torch.device, dtype: torch.dtype) -> str:
    """``packed`` on a CPU in float32 where oneDNN is there (``transposed`` where not),
    ``linear`` elsewhere: the fastest measured (``bench/compact_forward.py``)."""
    if device.type != "cpu" or dtype != torch.float32:
        return "linear"
    return "packed" if packing_available() else "transposed"


def default_dtype(model) -> torch.dtype:
    """float16 on a CPU (a draft step there is bound by reading the weights, and float16 halves
    them), the model's own dtype elsewhere."""
    weight = model.get_input_embeddings().weight
    return torch.float16 if weight.device.type == "cpu" else weight.dtype


@dataclass
class _Layer:
    """One decoder layer's weights in the session's dtype."""

    norm1: torch.Tensor
    q: tuple
    k: tuple
    v: tuple
    o: tuple
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    norm2: torch.Tensor
    gate: tuple
    up: tuple
    down: tuple


class CompactSession(ModelSession):
    """A :class:`ModelSession` (batch size 1) with the lean forward; same interface.

    Args:
        model: a supported causal LM (see :func:`supports`).
        dtype: the dtype of the session's computation (default: :func:`default_dtype`); logits
            are returned in float32. In another dtype than the model's the session keeps a
            converted copy of the weights, refreshed by :meth:`reset` (a new sequence) when the
            model's parameters have changed in place since (an optimizer step).
        hidden_layers: decoder-layer outputs returned in ``self.hidden``, as in
            :class:`ModelSession` (the last layer after the final norm).
        timed: accumulate forward seconds, as in :class:`ModelSession`.
        capacity: initial KV-cache length; it doubles when exceeded.
        layout: how the linear layers are computed (:data:`LAYOUTS`; default:
            :func:`default_layout`).
    """

    def __init__(
        self,
        model,
        dtype: torch.dtype | None = None,
        hidden_layers: Sequence[int] = (),
        timed: bool = True,
        capacity: int = 1024,
        layout: str | None = None,
    ):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a supported Llama-family model")
        config = model.config.get_text_config()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.dtype = dtype or default_dtype(model)
        self.capacity = capacity
        self._packed_version: int | None = None
        device = next(model.parameters()).device
        self.layout = layout or default_layout(device, self.dtype)
        if self.layout not in LAYOUTS:
            raise ValueError(f"compact layout {self.layout!r}: expected one of {list(LAYOUTS)}")
        if self.layout == "packed" and default_layout(device, self.dtype) != "packed":
            raise ValueError("compact layout 'packed': needs float32 on a CPU, torch with oneDNN")
        self.linear = LAYOUTS[self.layout]
        num_layers = len(model.model.layers)
        # layer position -> the index as requested
        self._keep = {resolve_layer(i, num_layers): i for i in hidden_layers}
        super().__init__(model, hidden_layers=hidden_layers, timed=timed)

    def reset(self) -> None:
        self._ids, self._pending, self.length, self.hidden = [], [], 0, {}
        self._pack()
        shape = (len(self.layers), 2, self.num_kv_heads, self.capacity, self.head_dim)
        self.kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        positions = torch.arange(self.capacity, device=self.device).unsqueeze(0)
        probe = self.model.get_input_embeddings().weight[:1].unsqueeze(0)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [capacity, head_dim]

    @torch.no_grad()
    def _pack(self) -> None:
        """(Re)build the session's weights when the model's parameters have changed."""
        version = sum(p._version for p in self.model.parameters())
        if version == self._packed_version:
            return
        dt, packed = self.dtype, self.layout == "packed"

        def linear(module) -> tuple:
            bias = None if module.bias is None else module.bias.detach().to(dt)
            weight = module.weight.detach().to(dt)
            if not packed:
                return weight, bias
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
            return weight, bias, reordered

        def norm(module) -> torch.Tensor | None:
            return None if module is None else module.weight.detach().to(dt)

        self.layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    norm(layer.input_layernorm),
                    *(linear(getattr(attn, f"{n}_proj")) for n in "qkvo"),
                    norm(getattr(attn, "q_norm", None)),
                    norm(getattr(attn, "k_norm", None)),
                    norm(layer.post_attention_layernorm),
                    *(linear(getattr(mlp, f"{n}_proj")) for n in ("gate", "up", "down")),
                )
            )
        self.final_norm = norm(self.model.model.norm)
        self.head = linear(self.model.get_output_embeddings())
        self.scaling = self.model.model.layers[0].self_attn.scaling
        self._packed_version = version

    def _grow(self, needed: int) -> None:
        kv, length, ids, pending = self.kv, self.length, self._ids, self._pending
        self.capacity = max(needed, 2 * self.capacity)
        self.reset()
        self._ids, self._pending, self.length = ids, pending, length
        self.kv[:, :, :, :length] = kv[:, :, :, :length]

    @torch.inference_mode()
    def extend(
        self,
        tokens: Sequence[int] | torch.Tensor,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            input_ids = tokens.to(self.device, torch.long).view(-1)
            self._pending.append(input_ids)
        else:
            input_ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
            self.ids.extend(tokens)
        m, start = input_ids.shape[0], self.length
        if start + m > self.capacity:
            self._grow(start + m)
        self.length = start + m
        t0 = self.clock() if self.timed else 0.0
        x = self._forward(input_ids, start, positions, mask)
        if last_only:
            x = x[-1:]
        logits = self.linear(x, *self.head).float()
        if self.timed:
            self.forward_seconds += self.clock() - t0
        self.forward_calls += 1
        return logits

    def _forward(self, input_ids, start: int, positions=None, mask=None) -> torch.Tensor:
        """Hidden states ``[m, H]`` after the final norm for ``input_ids`` in cache slots
        ``start..``, at ``positions`` (default: the slots) under ``mask`` (``[m, w]`` over the
        last w keys, the earlier ones visible; default: causal among the new tokens, everything
        cached visible)."""
        m, end = input_ids.shape[0], start + input_ids.shape[0]
        if positions is None:
            cos, sin = self.cos[start:end], self.sin[start:end]
        else:
            positions = positions.to(self.device)
            cos, sin = self.cos[positions], self.sin[positions]
        self.hidden = {}
        if mask is not None:
            mask = full_mask(mask, end, self.device)
        elif m > 1:
            mask = torch.ones(m, end, dtype=torch.bool, device=self.device).tril(start)
        last = len(self.layers) - 1
        x = self.model.get_input_embeddings()(input_ids).to(self.dtype)
        for i, (layer, cache) in enumerate(zip(self.layers, self.kv, strict=True)):
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            cache[0, :, start:end] = k.transpose(0, 1)
            cache[1, :, start:end] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                cache[0, :, :end],
                cache[1, :, :end],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            x = self.layer_output(layer, x, out.transpose(0, 1).reshape(m, -1))
            if i in self._keep and i != last:
                self.hidden[self._keep[i]] = x
        x = self._norm(x, self.final_norm)
        if last in self._keep:
            self.hidden[self._keep[last]] = x
        return x

    def attention_inputs(self, layer: _Layer, x: torch.Tensor, cos, sin) -> tuple:
        """A decoder layer's queries ``[m, heads, head_dim]``, keys and values ``[m, kv_heads,
        head_dim]`` for ``x`` ``[m, H]``, rotated by ``cos``/``sin`` ``[m, head_dim]``."""
        m, linear = x.shape[0], self.linear
        h = self._norm(x, layer.norm1)
        q = linear(h, *layer.q).view(m, self.num_heads, self.head_dim)
        k = linear(h, *layer.k).view(m, self.num_kv_heads, self.head_dim)
        v = linear(h, *layer.v).view(m, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3: per-head norm before the rotation
            q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def layer_output(self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output for input ``x`` ``[m, H]`` whose attention read
        ``attended`` ``[m, heads * head_dim]``: output projection, MLP, both residuals."""
        linear = self.linear
        x = x + linear(attended, *layer.o)
        h = self._norm(x, layer.norm2)
        return x + linear(F.silu(linear(h, *layer.gate)) * linear(h, *layer.up), *layer.down)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: normalised in float32, scaled by the weight."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)

    @torch.inference_mode()
    def keep(self, indices: Sequence[int]) -> None:
        start, tail = moved_tail(indices)
        if tail:
            end = start + len(tail)
            self.kv[:, :, :, start:end] = self.kv.index_select(
                3, torch.tensor(tail, device=self.device)
            )
            ids = self.ids
            ids[start:end] = [ids[i] for i in tail]
        self.rollback(len(indices))

    def rollback(self, length: int) -> None:
        if length < self.length:
            del self.ids[length:]
            self.length = length  # the buffers past it are overwritten by the next extend


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[m, heads, head_dim]`` (halves rotated, as in Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
