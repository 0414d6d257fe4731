"""Regeneration through the target's own ``generate`` (the default backend).

A batch of prompts is left-padded into one ``generate`` call, greedy or sampled; sampling draws
each prompt's tokens from its own generator seeded by ``(seed, prompt id)``, so a row does not
depend on the prompts it is batched with.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from specdec.decoding.sampling import SamplingParams, probabilities


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The prompt's own 63-bit seed: its sampled tokens do not depend on its batch."""
    key = hashlib.sha256(f"{seed}\0{prompt_id}".encode()).digest()
    return int.from_bytes(key[:8], "little") >> 1


def prompt_generator(seed: int, prompt_id: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(prompt_seed(seed, prompt_id))


class _PerPromptSampler(LogitsProcessor):
    """Draws each row's token from its own generator and leaves only that token to argmax.

    transformers' sampling uses one random stream for the whole batch, so a prompt's response
    would depend on its neighbours; drawing here with greedy ``generate`` keeps it per prompt.
    """

    def __init__(self, params: SamplingParams, generators: list[torch.Generator]):
        self.params = params
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = probabilities(scores, self.params)  # [B, V]
        pairs = zip(probs, self.generators, strict=True)
        drawn = [torch.multinomial(p, 1, generator=g) for p, g in pairs]
        chosen = torch.cat(drawn)[:, None]  # [B, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class BatchGenerator:
    """Left-pads a batch of prompts, calls ``generate`` and strips padding and EOS."""

    def __init__(self, model, params: SamplingParams, seed: int, eos_ids, pad_id, max_new: int):
        self.model = model
        self.params = params
        self.seed = seed
        self.eos_ids = set(eos_ids)
        # padding is masked on the way in and cut (after the first EOS) on the way out
        self.pad_id = eos_ids[0] if pad_id is None else pad_id
        # greedy decoding always; sampling, when asked for, happens in _PerPromptSampler
        self.config = GenerationConfig(
            max_new_tokens=max_new,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=eos_ids,
            pad_token_id=self.pad_id,
        )

    def __call__(self, batch: list) -> list[tuple[list[int], bool]]:
        """Returns, per prompt, the new token ids (EOS kept) and whether EOS ended them."""
        device = next(self.model.parameters()).device
        width = max(len(p.token_ids) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            input_ids[i, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
            attention_mask[i, width - len(p.token_ids) :] = 1
        processors = LogitsProcessorList()
        if not self.params.greedy:
            gens = [prompt_generator(self.seed, p.id, device) for p in batch]
            processors.append(_PerPromptSampler(self.params, gens))
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.config,
                logits_processor=processors,
            )
        results = []
        for row in out[:, width:].tolist():
            end = next((t for t, tok in enumerate(row) if tok in self.eos_ids), None)
            results.append((row, False) if end is None else (row[: end + 1], True))
        return results
