"""On-policy data: the drafter's own continuations of training prompts (DistillSpec).

Acceptance is an expectation over the drafter's own tokens (Σ min(p, q) along what q
proposes), so the divergence that decides it is the one measured where q puts its mass.
DistillSpec (Zhou et al. 2024) trains on text the draft generates itself and reports 10-45%
over fixed data. Here, every ``data.on_policy.refresh_every`` optimizer steps the drafter
continues ``prompts`` training prompts at ``temperature`` (:func:`rollout`); the training loop
draws a ``fraction`` of its micro-batches from these rows (:class:`PolicyPool`), where the
target's logits on the continuation are computed online and are the teacher, as for any row.

A rollout runs through the drafter's decoding face, so it serves every family: each round
the drafter proposes k tokens sampled from its own distribution and all are kept; the target
reads them in one forward only to hand the drafter its features for the next round (a family
that reads no target features never waits for the target). In the decoder's terms
(:mod:`specdec.decoding.speculative`) the round's last draft token plays the part of the
target's own token: the drafter is told that the other k - 1 were accepted, and the target's
cache holds every token but that last one, as between decoding rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from datasets import Dataset

from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.target import eos_token_ids

#: the data source of on-policy rows in the per-source training accuracy
POLICY_SOURCE = "drafter/on-policy"


@torch.inference_mode()
def rollout(
    target: ModelSession,
    drafter,
    prompt: Sequence[int],
    *,
    k: int,
    max_new_tokens: int,
    params: SamplingParams,
    eos: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> list[int]:
    """The drafter's own continuation of ``prompt`` (EOS included when it drafts one).

    Args:
        target: the target's session (reset here); it runs only for drafters that read its
            features.
        drafter: a drafter's decoding face.
        prompt: prompt token ids (at least two for a drafter that reads the target).
        k: tokens drafted per round.
        max_new_tokens: the continuation's length at most.
        params: the drafter's sampling (greedy at temperature 0).
        eos: tokens that end the continuation.
        generator: randomness of the drafter's samples.
    """
    reads = bool(drafter.required_target_layers)
    target.reset()
    features = None
    if reads:  # every token but the last is in the target's cache
        target.extend(list(prompt[:-1]), last_only=True)
        features = target.hidden
    drafter.begin(prompt[:-1], features)
    sequence, new, stop = list(prompt), [], set(eos)
    while len(new) < max_new_tokens and not (new and new[-1] in stop):
        draft = drafter.propose(sequence, min(k, max_new_tokens - len(new)), params, generator)
        tokens = draft.tokens.tolist()
        ends = [i for i, t in enumerate(tokens) if t in stop]
        tokens = tokens[: ends[0] + 1] if ends else tokens
        if not tokens:
            break
        features = None
        if reads:  # the token before the draft and all draft tokens but the last
            target.extend(torch.tensor(sequence[-1:] + tokens[:-1]), last_only=True)
            features = target.hidden
        drafter.commit(len(tokens) - 1, features)
        sequence += tokens
        new += tokens
    return new


def prompt_of(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """The tokens of a training row before its first trained one (its first prompt)."""
    first = list(loss_mask).index(1) if 1 in loss_mask else len(input_ids)
    return list(input_ids[:first])


class PolicyPool:
    """The drafter's latest continuations, and which micro-batches are drawn from them.

    Registered for checkpointing, so a resumed run trains on the rows it would have trained
    on (rollouts depend on the weights of the step they were made at).
    """

    def __init__(self, config, seed: int, max_length: int):
        self.config, self.seed, self.max_length = config, seed, max_length
        self.rows: dict[str, list] = {"input_ids": [], "loss_mask": []}
        self.refreshes = 0  # rollouts made so far
        self.step = -1  # the step of the last refresh
        self.stats: dict[str, float] = {}  # the last refresh's, for the next log line
        self._dataset = None

    def state_dict(self) -> dict:
        return {"rows": self.rows, "refreshes": self.refreshes, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.rows, self.refreshes, self.step = state["rows"], state["refreshes"], state["step"]
        self._dataset = None

    def due(self, step: int) -> bool:
        """Whether the drafter continues prompts before optimizer step ``step + 1``."""
        every = self.config.refresh_every
        return step > 0 and step % every == 0 and step != self.step

    def split(self, step: int, slots: int) -> tuple[int, int]:
        """``(first, count)``: of a step's ``slots`` micro-batches the first ``count`` are
        on-policy, global on-policy micro-batches ``first ..``; the share over the steps since
        the first refresh is ``fraction``, exactly up to rounding."""
        if not self.rows["input_ids"]:
            return 0, 0
        s, f = step - self.config.refresh_every, self.config.fraction
        first = math.floor(f * s * slots)
        return first, math.floor(f * (s + 1) * slots) - first

    @property
    def dataset(self) -> Dataset:
        """The pool's rows (``input_ids``, ``loss_mask``)."""
        if self._dataset is None:
            self._dataset = Dataset.from_dict(self.rows)
        return self._dataset

    @property
    def batch_seed(self) -> int:
        """The seed of the pool's batch order: anew for each refresh."""
        return self.seed + self.refreshes

    def refresh(self, target, drafter, dataset, train_rows: torch.Tensor, step: int, accelerator):
        """Continue ``prompts`` training prompts (picked anew each refresh) with the drafter;
        each process rolls out its share and all hold the whole pool."""
        from accelerate.utils import gather_object

        cfg, t0 = self.config, time.perf_counter()
        generator = torch.Generator().manual_seed(self.seed + 7919 * (self.refreshes + 1))
        picked = train_rows[torch.randperm(len(train_rows), generator=generator)]
        picked = picked[: cfg.prompts].tolist()
        rows = dataset.select(picked)
        session = target_session(target.model, "auto", drafter.required_target_layers)
        eos = eos_token_ids(target.model, target.tokenizer)
        params = SamplingParams(cfg.temperature)
        module = drafter.module
        was_training = module.training
        module.eval()
        drafter.configure(drafter.forward or "auto", 0.0)  # as decoding runs; k tokens a round
        mine = []
        for i in range(accelerator.process_index, len(picked), accelerator.num_processes):
            prompt = prompt_of(rows[i]["input_ids"], rows[i]["loss_mask"])
            budget = min(cfg.max_new_tokens, self.max_length - len(prompt))
            seed = self.seed + 1_000_003 * (self.refreshes + 1) + i
            gen = torch.Generator(device=session.device).manual_seed(seed)
            new = rollout(
                session, drafter, prompt, k=cfg.k, max_new_tokens=budget, params=params,
                eos=eos, generator=gen,
            )  # fmt: skip
            mine.append((i, prompt + new, [0] * len(prompt) + [1] * len(new)))
        module.train(was_training)
        made = sorted(gather_object(mine))
        self.rows = {"input_ids": [r[1] for r in made], "loss_mask": [r[2] for r in made]}
        self._dataset, self.step = None, step
        self.refreshes += 1
        seconds = time.perf_counter() - t0
        tokens = sum(sum(mask) for mask in self.rows["loss_mask"])
        self.stats = {
            "train/rollout_seconds": seconds,
            "train/rollout_tokens_per_second": tokens / seconds,
            "train/rollout_length": tokens / max(len(made), 1),
        }
