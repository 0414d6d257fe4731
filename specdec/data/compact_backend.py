"""Regeneration through the compact forward (``data.regenerate.backend: compact``).

The target's prompts are decoded in the slots of one :class:`~specdec.decoding.compact_batch.
CompactBatch`: a prompt's forward runs alone, then every slot advances by one token per step,
and a slot whose answer has ended takes the next prompt at once (continuous batching). No step
is spent on padding or on answers that are done, and the linear layers run through the
compact session's weight layout, so on a CPU this writes the same answers up to twice as fast
as the target's ``generate`` (``bench/regenerate_throughput.py``). Llama, Qwen2 and Qwen3
targets only (:func:`specdec.decoding.compact.supports`).

Greedy rows are the target's greedy answers up to floating-point ties, as with ``generate``.
Sampled rows draw each token from the prompt's own generator (seeded by ``(seed, prompt id)``)
through ``choose`` (``probabilities``, then one multinomial draw, as the transformers backend
draws), so a row does not depend on the prompts it is decoded beside.
"""

from __future__ import annotations

import torch

from specdec.data.transformers_backend import prompt_generator
from specdec.decoding.compact import supports
from specdec.decoding.compact_batch import CompactBatch
from specdec.decoding.sampling import SamplingParams, choose
from specdec.errors import DataError


def check_supported(model) -> None:
    """Raises :class:`DataError` when the compact forward cannot run ``model``."""
    if not supports(model):
        raise DataError(
            f"data.regenerate.backend: 'compact' has no forward for {type(model).__name__} "
            "(Llama, Qwen2, Qwen3 only); use 'transformers'"
        )


class CompactGenerator:
    """Called with a list of prompts, returns per prompt the new token ids (EOS kept) and
    whether EOS ended them: the interface of the transformers backend's batch generator.

    Args:
        model: the target (a supported Llama-family model).
        params: greedy or sampled.
        seed: with each prompt id, the prompt's seed (sampling only).
        eos_ids: tokens that end an answer.
        max_new: the length limit of an answer.
        slots: prompts decoded at once.
        max_tokens: at most this many tokens in the cache (slots times the longest prompt and
            answer); fewer slots where they would not fit. None: no limit.
    """

    def __init__(
        self, model, params: SamplingParams, seed: int, eos_ids, max_new: int, slots: int,
        max_tokens: int | None = None,
    ):  # fmt: skip
        check_supported(model)
        self.model, self.params, self.seed = model, params, seed
        self.eos_ids, self.max_new, self.slots = set(eos_ids), max_new, slots
        self.max_tokens = max_tokens
        self.batch: CompactBatch | None = None

    def _engine(self, slots: int, capacity: int) -> CompactBatch:
        """The decoding slots, kept between calls while they are large enough."""
        old = self.batch
        if old is None or old.slots != slots or old.capacity < capacity:
            self.batch = None  # the old cache is released before the new one is made
            self.batch = CompactBatch(self.model, slots, capacity)
        return self.batch

    def __call__(self, prompts: list) -> list[tuple[list[int], bool]]:
        capacity = max(len(p.token_ids) for p in prompts) + self.max_new
        slots = min(self.slots, len(prompts))
        if self.max_tokens is not None:
            slots = max(1, min(slots, self.max_tokens // capacity))
        batch = self._engine(slots, capacity)
        results: list[tuple[list[int], bool] | None] = [None] * len(prompts)
        waiting = list(range(len(prompts)))[::-1]  # popped from the end: in order
        held: dict[int, tuple[int, list[int], torch.Generator | None]] = {}
        tokens = torch.zeros(batch.slots, dtype=torch.long)

        def take(slot: int, logits: torch.Tensor) -> None:
            """The slot's next token from its logits ``[V]``; ends its answer or holds it."""
            index, ids, gen = held[slot]
            token = int(choose(logits, self.params, gen))
            ids.append(token)
            tokens[slot] = token
            ended = token in self.eos_ids
            if ended or len(ids) == self.max_new:
                results[index] = (ids, ended)
                del held[slot]

        def fill(slot: int) -> None:
            """Starts waiting prompts in ``slot`` until one is held there or none is left."""
            while slot not in held and waiting:
                index = waiting.pop()
                prompt, gen = prompts[index], None
                if not self.params.greedy:
                    gen = prompt_generator(self.seed, prompt.id, batch.device)
                held[slot] = (index, [], gen)
                take(slot, batch.start(slot, prompt.token_ids))
            if slot not in held:
                batch.free(slot)

        for slot in range(batch.slots):
            fill(slot)
        while held:
            logits = batch.step(tokens)
            for slot in list(held):
                take(slot, logits[slot])
                fill(slot)
        return results  # type: ignore[return-value]
