"""Slots of the batched compact forward: each computes what the model computes for its own
sequence alone, whatever the other slots hold, start again or leave empty."""

from __future__ import annotations

import pytest
import torch
from test_compact import LAYOUTS, SIZES, _model
from transformers import GemmaConfig, GemmaForCausalLM

from specdec.data.compact_backend import CompactGenerator
from specdec.data.regenerate import _Prompt, regenerate
from specdec.decoding.compact_batch import CompactBatch
from specdec.decoding.sampling import SamplingParams
from specdec.errors import DataError


def alone(model, ids: list[int]) -> torch.Tensor:
    """The logits after ``ids``: transformers' forward over the whole sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_slots_match_each_sequence_alone(family, layout):
    model = _model(family)
    batch = CompactBatch(model, slots=3, capacity=24, layout=layout)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 13, 1)]
    for slot, ids in enumerate(seqs):
        close(batch.start(slot, ids), alone(model, ids))

    def step(slots: list[int]) -> None:
        tokens = torch.randint(0, 97, (3,), generator=g)
        logits = batch.step(tokens)
        for slot in slots:  # each slot at its own position, over its own columns only
            seqs[slot].append(int(tokens[slot]))
            close(logits[slot], alone(model, seqs[slot]))

    for _ in range(3):
        step([0, 1, 2])
    batch.free(2)
    step([0, 1])
    assert batch.lengths.tolist() == [9, 17, 0]  # an empty slot stays empty
    # slot 1 starts again with a shorter sequence: its older, longer columns must not be seen
    seqs[1] = torch.randint(0, 97, (4,), generator=g).tolist()
    close(batch.start(1, seqs[1]), alone(model, seqs[1]))
    for _ in range(2):
        step([0, 1])
    seqs[2] = [7]
    close(batch.start(2, seqs[2]), alone(model, seqs[2]))
    step([0, 1, 2])
    assert batch.lengths.tolist() == [len(s) for s in seqs]


def test_full_slots_and_long_sequences_are_refused():
    batch = CompactBatch(_model("llama"), slots=2, capacity=4)
    with pytest.raises(ValueError, match="4 tokens in slots of 4"):
        batch.start(0, [1, 2, 3, 4])
    batch.start(0, [1, 2, 3])
    batch.step(torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="full"):
        batch.step(torch.tensor([6, 0]))


def test_compact_backend_refuses_other_architectures(tiny_llama, tmp_path):
    model = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16)).eval()
    message = "'compact' has no forward for GemmaForCausalLM"
    with pytest.raises(DataError, match=message):
        CompactGenerator(model, SamplingParams(), 0, [1], 4, slots=2)
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataError, match=message):
        regenerate(model, tiny_llama[1], prompts, tmp_path / "out", backend="compact")
    assert not (tmp_path / "out").exists()  # refused before the directory records anything


def test_token_budget_takes_fewer_slots_and_the_same_answers(tiny_llama):
    model, tokenizer = tiny_llama
    g = torch.Generator().manual_seed(0)
    prompts = [
        _Prompt(i, f"p{i}", [], None, torch.randint(0, 300, (n,), generator=g).tolist())
        for i, n in enumerate([9, 3, 14, 6, 1])
    ]
    settings = (SamplingParams(), 0, [tokenizer.eos_token_id], 6)
    wide = CompactGenerator(model, *settings, slots=4)
    narrow = CompactGenerator(model, *settings, slots=4, max_tokens=2 * (14 + 6) + 1)
    assert narrow(prompts) == wide(prompts)
    assert (wide.batch.slots, narrow.batch.slots) == (4, 2)
