"""Regeneration through vLLM, when it is installed (``data.regenerate.backend: vllm``).

vLLM batches and pages the KV cache itself, so on a GPU it writes a large prompt set many times
faster than ``generate``. It takes the same tokenized prompts (chat template applied by
specdec, so both backends answer the same text) and the same sampling settings; each prompt
carries its own seed, derived from ``(seed, prompt id)`` as the transformers backend does, so a
row does not depend on its batch. vLLM samples with its own kernels: sampled rows are drawn
from the same distribution as the transformers backend's, not token-identical to them; greedy
rows match up to floating-point ties (vLLM's kernels and precision differ).
"""

from __future__ import annotations

import importlib.util

from specdec.errors import DataError

INSTALL_HINT = "pip install vllm (a CUDA machine), or use data.regenerate.backend: transformers"


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMGenerator:
    """Called with a batch of prompts, returns per prompt the new token ids (EOS kept) and
    whether EOS ended them: the interface of the transformers backend's batch generator.

    Args:
        model_path: what ``vllm.LLM`` loads (the target's directory or hub id).
        dtype: the target's dtype name, e.g. ``"float32"``.
        params: temperature, top-k, top-p (:class:`specdec.decoding.sampling.SamplingParams`).
        seed: with each prompt id, the prompt's seed.
        eos_ids: tokens that end a response.
        max_new_tokens: the length limit.
    """

    def __init__(self, model_path: str, dtype: str, params, seed: int, eos_ids, max_new_tokens):
        if not available():
            raise DataError(f"data.regenerate.backend: 'vllm' is not installed; {INSTALL_HINT}")
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed)
        self.params, self.seed, self.max_new = params, seed, max_new_tokens
        self.eos_ids = list(eos_ids)

    def sampling(self, prompt_id: str):
        from specdec.data.transformers_backend import prompt_seed

        greedy = self.params.greedy
        return self.vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else self.params.temperature,
            top_p=1.0 if greedy else self.params.top_p,
            top_k=-1 if greedy or self.params.top_k <= 0 else self.params.top_k,
            max_tokens=self.max_new,
            seed=prompt_seed(self.seed, prompt_id),
            stop_token_ids=self.eos_ids,
            ignore_eos=False,
        )

    def __call__(self, batch) -> list[tuple[list[int], bool]]:
        prompts = [{"prompt_token_ids": list(p.token_ids)} for p in batch]
        params = [self.sampling(p.id) for p in batch]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._ids(out.outputs[0]) for out in outputs]

    def _ids(self, completion) -> tuple[list[int], bool]:
        ids = list(completion.token_ids)
        end = next((t for t, tok in enumerate(ids) if tok in self.eos_ids), None)
        if end is not None:
            return ids[: end + 1], True
        if completion.finish_reason == "stop":  # vLLM left the stop token out
            return [*ids, self.eos_ids[0]], True
        return ids, False
