"""Many sequences decoded together on the compact forward: slots of one KV cache.

Writing training data means decoding thousands of prompts with the target, one token at a time.
A decoding step of a small model on a CPU is bound by reading its weights, so it pays to step
many sequences at once; the session's kernels are measured per row count
(:mod:`specdec.decoding.kernels`), and for a batch of rows oneDNN's reordered weights are often
the fastest (on two cores of an AMD EPYC SmolLM2-135M's linear layers took about 40 ms for 16
rows that way against 85 ms through ``F.linear``, which transformers' forward uses; 45 ms on
an Intel Xeon with AMX).

:class:`CompactBatch` keeps ``slots`` sequences in one preallocated cache. Each slot holds its
own sequence from cache column 0 with its own length, so sequences of different lengths need
no padding: a slot is filled by :meth:`CompactBatch.start` (the prompt's forward, alone, through
:class:`~specdec.decoding.compact.CompactSession`), then :meth:`CompactBatch.step` advances
every slot by one token, each at its own position, attending only to its own columns. A slot
whose sequence has ended can be started again with the next prompt while the others go on
(continuous batching), so no step is spent on padding or on rows that are already done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.decoding.compact import CompactSession


class CompactBatch:
    """``slots`` sequences of one Llama-family model, stepped together.

    Args:
        model: a model :func:`specdec.decoding.compact.supports`.
        slots: how many sequences are held at once.
        capacity: the longest sequence a slot holds (prompt and new tokens).
        layout: how the linear layers are computed (default: the compact session's).

    Computes in the model's own dtype, so the logits are those of the model's forward up to
    floating-point rounding; they are returned in float32.
    """

    def __init__(self, model, slots: int, capacity: int, layout: str | None = None):
        dtype = model.get_input_embeddings().weight.dtype
        self.session = CompactSession(model, dtype, timed=False, capacity=capacity, layout=layout)
        s = self.session
        self.slots, self.capacity, self.device = slots, capacity, s.device
        shape = (len(s.layers), 2, slots, s.num_kv_heads, capacity, s.head_dim)
        self.kv = torch.zeros(shape, dtype=s.dtype, device=self.device)
        #: tokens each slot holds; the next token of slot i is computed at position lengths[i]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)
        #: slots that hold a sequence (an empty one is stepped on column 0 and stays empty)
        self.active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self._rows = torch.arange(slots, device=self.device)

    @torch.inference_mode()
    def start(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Puts ``token_ids`` into ``slot`` (whatever it held is dropped); returns the logits
        ``[V]`` that follow them."""
        if not 0 < len(token_ids) < self.capacity:
            raise ValueError(f"a sequence of {len(token_ids)} tokens in slots of {self.capacity}")
        s, m = self.session, len(token_ids)
        s.rollback(0)
        logits = s.extend(list(token_ids), last_only=True)[0]
        self.kv[:, :, slot, :, :m] = s.kv[:, :, :, :m]
        self.lengths[slot], self.active[slot] = m, True
        return logits

    def free(self, slot: int) -> None:
        """Empties ``slot``: its rows in later steps cost compute but touch no sequence."""
        self.lengths[slot], self.active[slot] = 0, False

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends ``tokens[i]`` (``[slots]``) to slot i for every slot; returns the logits
        ``[slots, V]`` that follow. A slot that is full (``capacity`` tokens) is an error."""
        s, n, pos = self.session, self.slots, self.lengths
        width = int(pos.max()) + 1
        if width > self.capacity:
            raise ValueError(f"a slot is full ({self.capacity} tokens)")
        cos, sin = s.cos[pos], s.sin[pos]  # [n, head_dim]
        # slot i sees its own columns 0..lengths[i] (the new token included)
        mask = (torch.arange(width, device=self.device) <= pos[:, None])[:, None, None, :]
        x = s.model.get_input_embeddings()(tokens.to(self.device)).to(s.dtype)  # [n, H]
        for layer, cache in zip(s.layers, self.kv, strict=True):
            q, k, v = s.attention_inputs(layer, x, cos, sin)
            cache[0, self._rows, :, pos] = k  # [n, kv_heads, head_dim] at each slot's column
            cache[1, self._rows, :, pos] = v
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),  # [n, heads, 1, head_dim]
                cache[0, :, :, :width],
                cache[1, :, :, :width],
                attn_mask=mask,
                scale=s.scaling,
                enable_gqa=s.num_heads != s.num_kv_heads,
            )
            x = s.layer_output(layer, x, out.reshape(n, -1))
        x = s._norm(x, s.final_norm)
        self.lengths += self.active
        return s.linear(x, *s.head).float()
