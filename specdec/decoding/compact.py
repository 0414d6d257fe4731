"""A lean decoding forward for Llama-family models: the drafter's inner loop and the target's.

A decoding step of a small model is dominated by per-call framework work and by how the weights
are read, not by arithmetic: on two CPU cores a 2-layer SmolLM2-sized draft spends most of its
~6 ms in module dispatch, mask construction and cache bookkeeping. :class:`CompactSession` runs
the same computation (RMSNorm, rotary embedding, grouped-query attention, gated MLP, LM head)
from the model's weights with a preallocated KV cache, so rolling back is moving an index. It
follows a model that is still being trained (see :meth:`CompactSession.reset`).

How the linear layers are computed is the session's ``layout`` (:data:`LAYOUTS`). Which kernel
reads the weights fastest differs by CPU and by row count (one new token, a verify of k + 1, a
tree, a prompt) by up to 2x either way, so on a CPU the default, ``tuned``, times the kernels of
:mod:`specdec.decoding.kernels` (in float32 also oneDNN's reordered weights) on the model's own
weights when a session starts (once per process; SmolLM2-135M: about 3 s) and uses the fastest
at each row count. Where it picks the reordered weights the session keeps a reordered copy of
each linear weight (as much memory again, refreshed with them). Elsewhere ``F.linear`` is the
one kernel (``bench/compact_forward.py`` prints every layout side by side).

Only architectures whose decoder layer is exactly that computation are accepted
(:func:`supports`); anything else keeps the general :class:`ModelSession`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.decoding import kernels
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


#: the fewest rows the ``packed`` layout multiplies with its reordered weights (fewer: ``W @ x.T``)
PACKED_FROM_ROWS = 3

#: how a session computes a linear layer, as ``{rows: kernel}`` (:mod:`kernels`): always
#: ``F.linear``, always ``W @ x.T``, ``packed`` (``W @ x.T`` below three rows, oneDNN's reordered
#: weights from three: the fastest on the host it was measured on), or ``tuned`` (measured here
#: when the session starts, :func:`kernels.measure`)
LAYOUTS: dict[str, dict[int, str] | None] = {
    "linear": {1: "linear"},
    "transposed": {1: "transposed"},
    "packed": {1: "transposed", PACKED_FROM_ROWS: "reordered"},
    "tuned": None,
}


def default_layout(device: torch.device) -> str:
    """``tuned`` on a CPU, where the kernels' speeds differ by host (``linear`` elsewhere,
    where it is the one kernel)."""
    return "tuned" if device.type == "cpu" else "linear"


def default_dtype(model) -> torch.dtype:
    """On a CPU, float16 or the model's own dtype, whichever decodes one token faster here
    (:func:`kernels.fastest_dtype`: a draft step there is bound by reading the weights); the
    model's own dtype elsewhere."""
    weight = model.get_input_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype == torch.float16:
        return weight.dtype
    return kernels.fastest_dtype(model, (torch.float16, weight.dtype))


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
        self.layout = layout or default_layout(device)
        if self.layout not in LAYOUTS:
            raise ValueError(f"compact layout {self.layout!r}: expected one of {list(LAYOUTS)}")
        uses = set((LAYOUTS[self.layout] or {}).values())
        if "reordered" in uses and "reordered" not in kernels.kernels_for(device, self.dtype):
            raise ValueError(
                f"compact layout {self.layout!r}: needs float32 on a CPU, torch with oneDNN"
            )
        self.linear: kernels.TunedLinear | None = None
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
        """(Re)build the session's weights when the model's parameters have changed, and choose
        the kernels of its layout (the ``tuned`` one measured here, once per process)."""
        version = sum(p._version for p in self.model.parameters())
        if version == self._packed_version:
            return
        dt, model = self.dtype, self.model

        def norm(module) -> torch.Tensor | None:
            return None if module is None else module.weight.detach().to(dt)

        modules = [
            *(
                getattr(part, f"{n}_proj")
                for layer in model.model.layers
                for part, names in ((layer.self_attn, "qkvo"), (layer.mlp, ("gate", "up", "down")))
                for n in names
            ),
            model.get_output_embeddings(),
        ]
        weights = [
            (m.weight.detach().to(dt), None if m.bias is None else m.bias.detach().to(dt))
            for m in modules
        ]
        choice, reordered = LAYOUTS[self.layout], None
        if choice is None:
            options = kernels.kernels_for(weights[0][0].device, dt)
            choice = kernels.measured(weights, options)
            if choice is None and "reordered" in options:  # timed on its reordered copies
                reordered = [(*t, kernels.reorder(t[0])) for t in weights]
                choice = kernels.measure(reordered, options)
            elif choice is None:
                choice = kernels.measure(weights, options)
        if "reordered" in choice.values():
            weights = reordered or [(*t, kernels.reorder(t[0])) for t in weights]
        self.linear = kernels.TunedLinear(choice)
        per_layer = iter(weights)
        self.layers = []
        for layer in model.model.layers:
            attn = [next(per_layer) for _ in range(4)]
            mlp = [next(per_layer) for _ in range(3)]
            self.layers.append(
                _Layer(
                    norm(layer.input_layernorm),
                    *attn,
                    norm(getattr(layer.self_attn, "q_norm", None)),
                    norm(getattr(layer.self_attn, "k_norm", None)),
                    norm(layer.post_attention_layernorm),
                    *mlp,
                )
            )
        self.final_norm = norm(model.model.norm)
        self.head = next(per_layer)
        self.scaling = model.model.layers[0].self_attn.scaling
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
