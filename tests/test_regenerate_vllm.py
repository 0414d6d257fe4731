"""The vLLM regeneration backend against a stand-in ``vllm`` module (vLLM itself needs a CUDA
machine): what it is asked for, and that its answers become the same rows as the
transformers backend's."""

import importlib.machinery
import sys
import types

import pytest
import torch
from test_regenerate import make_eos_reachable, make_prompts, sharpen

from specdec.config import load_recipe
from specdec.data.regenerate import load_regenerated, regenerate
from specdec.data.transformers_backend import prompt_seed
from specdec.errors import ConfigError


class Completion:
    def __init__(self, token_ids, finish_reason):
        self.token_ids, self.finish_reason = token_ids, finish_reason


def stand_in_vllm(model, calls: list) -> types.ModuleType:
    """A ``vllm`` module whose LLM answers greedily with ``model``, one prompt at a time, and
    (as vLLM may) leaves the stop token out of every other finished answer."""
    finished = []
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("LLM", kwargs))

        def generate(self, prompts, params, use_tqdm=True):
            calls.append(("generate", params))
            out = []
            for prompt, p in zip(prompts, params, strict=True):
                ids = torch.tensor([prompt["prompt_token_ids"]])
                with torch.no_grad():
                    new = model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=p.max_tokens, eos_token_id=p.stop_token_ids,
                    )[0, ids.shape[1] :].tolist()  # fmt: skip
                stop = next((t for t, x in enumerate(new) if x in p.stop_token_ids), None)
                if stop is None:
                    out.append(types.SimpleNamespace(outputs=[Completion(new, "length")]))
                else:
                    finished.append(1)
                    kept = new[: stop + len(finished) % 2]  # the first without its stop token
                    out.append(types.SimpleNamespace(outputs=[Completion(kept, "stop")]))
            return out

    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module


def test_vllm_backend_rows_and_requests(tiny_llama, tmp_path, monkeypatch):
    model, tokenizer = tiny_llama
    sharpen(model)
    eos = tokenizer.eos_token_id
    prompts = make_prompts(9)
    for i in (1, 4, 6):  # both kinds of row: some answers end with EOS
        make_eos_reachable(model, tokenizer, prompts[i])
    settings = {"max_new_tokens": 12, "batch_size": 4, "shard_size": 4, "progress": False}
    regenerate(model, tokenizer, prompts, tmp_path / "hf", **settings)
    calls = []
    monkeypatch.setitem(sys.modules, "vllm", stand_in_vllm(model, calls))
    stats = regenerate(model, tokenizer, prompts, tmp_path / "vllm", backend="vllm", **settings)
    rows = load_regenerated(tmp_path / "vllm").to_list()
    assert rows == load_regenerated(tmp_path / "hf").to_list()
    assert 0 < stats.truncated < 8  # two answers at least end with EOS: both branches
    assert calls[0] == ("LLM", {"model": model.config._name_or_path, "dtype": "float64", "seed": 0})
    requests = [p for kind, p in calls if kind == "generate" for p in p]
    assert len(requests) == 9
    assert {p.seed for p in requests} == {prompt_seed(0, p["id"]) for p in prompts}
    first = requests[0]
    assert (first.temperature, first.top_k, first.top_p, first.max_tokens) == (0.0, -1, 1.0, 12)
    assert first.stop_token_ids == [eos]

    calls.clear()
    sampled = {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 3}
    regenerate(model, tokenizer, prompts[:2], tmp_path / "s", backend="vllm", **settings | sampled)
    p = calls[1][1][0]
    assert (p.temperature, p.top_k, p.top_p) == (0.8, 5, 0.9)
    assert p.seed in {prompt_seed(3, q["id"]) for q in prompts[:2]}


def test_vllm_backend_refused_before_any_model_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec then says: not installed
    message = "data.regenerate.backend=vllm: 'vllm' is not installed here"
    with pytest.raises(ConfigError, match=message):
        load_recipe("recipes/debug/tiny.yaml", ["data.regenerate.backend=vllm"])
