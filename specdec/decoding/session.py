"""A causal LM with its KV cache, stepped forward and rolled back by token count.

Both the frozen target and an independent draft model are driven through a :class:`ModelSession`:
``extend`` runs the model over new tokens on top of the cache and returns their logits;
``rollback`` crops the cache after a rejection. The session remembers which tokens its cache
holds, so a drafter re-synchronises with the accepted sequence by comparing prefixes instead
of trusting bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdec.layers import resolve_layer


class Clock:
    """Wall-clock seconds that include the device's queued work (syncs CUDA before reading)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class ModelSession:
    """One sequence (batch size 1) of a causal LM with a cache.

    Args:
        model: a transformers causal LM, in eval mode.
        hidden_layers: decoder-layer indices whose outputs ``extend`` also returns, numbered as
            :func:`specdec.target.resolve_layer` numbers them (layer i is transformers'
            ``hidden_states[i + 1]``; negatives count from the end; the last layer is after
            the final norm). ``self.hidden`` is keyed by the indices as given.
        timed: accumulate the time spent in forwards (``forward_seconds``). On CUDA this
            synchronizes around every forward; turn it off where that matters more than the
            breakdown.
    """

    def __init__(self, model, hidden_layers: Sequence[int] = (), timed: bool = True):
        self.model = model
        self.timed = timed
        self.device = next(model.parameters()).device
        self.hidden_layers = tuple(hidden_layers)
        num_layers = model.config.get_text_config().num_hidden_layers
        self._states = {i: resolve_layer(i, num_layers) + 1 for i in self.hidden_layers}
        self.clock = Clock(self.device)
        self.forward_seconds = 0.0
        self.forward_calls = 0
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        # sliding-window layers (Gemma 3, Mistral) must keep their past to allow a rollback
        self.cache.activate_past_recording()
        self._ids: list[int] = []
        self._pending: list[torch.Tensor] = []  # fed as device tensors, not yet read back
        self.length = 0
        self.hidden: dict[int, torch.Tensor] = {}

    @property
    def ids(self) -> list[int]:
        """The cached tokens (reading them back from the device once, lazily)."""
        if self._pending:
            self._ids += torch.cat(self._pending).tolist()
            self._pending = []
        return self._ids

    @torch.inference_mode()
    def extend(
        self,
        tokens: Sequence[int] | torch.Tensor,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model over ``tokens`` after the cached ones.

        Args:
            tokens: the new token ids (a list, or a device tensor to avoid a host sync).
            last_only: compute logits for the last position only (a prefill or a catch-up
                feed needs no more; the LM head is a large share of a small model's cost).
            positions: ``[m]`` position ids of the new tokens; None: right after the cache.
            mask: ``[m, w]`` booleans over the last w keys (w <= cached + m; the keys before
                them are visible to every new token), True where a new token may attend (a
                draft tree: each node sees the cache, its ancestors and itself); None: causal.

        Returns:
            ``[m, V]`` logits (``[1, V]`` with ``last_only``), row j predicting the token after
            ``tokens[j]``. The outputs of
            the requested hidden layers for these positions are left in ``self.hidden``
            (``{layer: [m, H]}``).
        """
        if isinstance(tokens, torch.Tensor):
            input_ids = tokens.to(self.device, torch.long).view(1, -1)
            self._pending.append(input_ids[0])
        else:
            input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            self.ids.extend(tokens)
        m = input_ids.shape[1]
        start = self.length
        self.length += m
        if positions is None:
            positions = torch.arange(start, start + m, device=self.device)
        extra = {}
        if mask is not None:  # transformers' public 4-D mask: additive, [batch, 1, m, kv]
            mask = full_mask(mask, start + m, self.device)
            blocked = torch.finfo(self.model.dtype).min
            additive = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device)
            extra["attention_mask"] = additive.masked_fill(~mask, blocked)[None, None]
        t0 = self.clock() if self.timed else 0.0
        out = self.model(
            input_ids=input_ids,
            position_ids=positions.to(self.device).view(1, -1),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=bool(self.hidden_layers),
            **extra,
        )
        logits = out.logits[0]
        if self.timed:
            self.forward_seconds += self.clock() - t0
        self.forward_calls += 1
        if self.hidden_layers:
            self.hidden = {i: out.hidden_states[j][0] for i, j in self._states.items()}
        return logits

    @torch.inference_mode()
    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached entries at ``indices`` (ascending), e.g. the verified prefix and
        the accepted path of a draft tree; ``keep(range(n))`` is a rollback to n tokens. Only
        the entries after the common prefix move."""
        start, tail = moved_tail(indices)
        if tail:
            index = torch.tensor(tail, device=self.device)
            end = start + len(tail)
            for layer in self.cache.layers:
                if getattr(layer, "is_sliding", False):
                    raise ValueError("keeping entries out of order needs full-attention layers")
                layer.keys[..., start:end, :] = layer.keys.index_select(-2, index)
                layer.values[..., start:end, :] = layer.values.index_select(-2, index)
            ids = self.ids
            ids[start:end] = [ids[i] for i in tail]
        self.rollback(len(indices))

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: the number of tokens to drop
            del self.ids[length:]
            self.length = length

    def sync(self, sequence: Sequence[int]) -> list[int]:
        """Roll back to the longest cached prefix of ``sequence``; return what is not cached."""
        sequence = list(sequence)
        if self.ids == sequence[: self.length]:
            common = self.length
        else:
            common, limit = 0, min(self.length, len(sequence))
            while common < limit and self.ids[common] == sequence[common]:
                common += 1
        self.rollback(common)
        return list(sequence[common:])


def moved_tail(indices: Sequence[int]) -> tuple[int, list[int]]:
    """``(start, tail)``: ``indices[:start]`` is ``0..start-1`` (entries that stay where they
    are), ``tail`` the rest (entries to move down to ``start..``)."""
    if isinstance(indices, range) and indices.start == 0 and indices.step == 1:
        return len(indices), []
    if isinstance(indices, Kept):
        start, rest = indices.prefix, indices.tail
    else:
        start, rest = 0, [int(i) for i in indices]
    i = 0
    while i < len(rest) and rest[i] == start + i:
        i += 1
    return start + i, rest[i:]


def full_mask(mask: torch.Tensor, keys: int, device=None) -> torch.Tensor:
    """A ``[m, w]`` mask over the last w of ``keys`` keys as ``[m, keys]``, the earlier keys
    visible."""
    mask = mask.to(device)
    if mask.shape[1] == keys:
        return mask
    seen = torch.ones(mask.shape[0], keys - mask.shape[1], dtype=torch.bool, device=mask.device)
    return torch.cat([seen, mask], dim=1)


class Kept(Sequence):
    """Cache indices ``0..prefix-1`` followed by ``tail``, without listing the prefix (a
    long sequence's tree round keeps the sequence and a short path)."""

    def __init__(self, prefix: int, tail: Sequence[int]):
        self.prefix, self.tail = prefix, [int(i) for i in tail]

    def __len__(self) -> int:
        return self.prefix + len(self.tail)

    def __getitem__(self, i: int) -> int:
        i = i + len(self) if i < 0 else i
        return i if i < self.prefix else self.tail[i - self.prefix]
