"""The scoring job: load a target and a drafter, score held-out prompts, write the report."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specdec import drafters
from specdec.config import PromptSource
from specdec.data.chat import prompt_messages
from specdec.drafters import Drafter, read_meta
from specdec.errors import ConfigError, DataError
from specdec.files import write_json
from specdec.scoring import report
from specdec.scoring.run import ScoreSettings, encode_prompt, score

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (PromptSource("mtbench"), PromptSource("humaneval"))


@dataclass
class ScoreJob:
    """What to score. Exactly one of ``checkpoint``, ``drafter`` or ``draft_model``."""

    checkpoint: str | None = None
    drafter: str | None = None
    draft_model: str | None = None
    target: str | None = None
    prompts: tuple[PromptSource, ...] = DEFAULT_PROMPTS
    num_prompts: int = 8
    out: str | None = None
    cache_dir: str | None = None
    dtype: str = "float32"
    max_ngram: int | None = None
    force: bool = False  # replace an existing score file
    certify: int = 0  # samples of the T = 1 losslessness test (0: greedy identity only)

    @property
    def out_path(self) -> Path:
        if self.out:
            return Path(self.out)
        return Path(self.checkpoint) / "score.json" if self.checkpoint else Path("score.json")


def build_drafter(job: ScoreJob, target) -> Drafter:
    """The drafter a job names, checked against the target."""
    if job.checkpoint:
        return drafters.load(job.checkpoint, target)
    if job.draft_model:
        return drafters.from_model(job.draft_model, target)
    _check_training_free(job.drafter)
    return drafters.build(target, drafters.config_for(job.drafter, max_ngram=job.max_ngram))


def _check_training_free(name: str) -> None:
    if drafters.is_trainable(name):
        raise ConfigError(
            f"drafter '{name}' is scored from a trained --checkpoint "
            "(or, for any transformers causal LM, --draft-model PATH_OR_ID)"
        )


def load_prompts(
    sources: tuple,
    num_prompts: int,
    cache_dir=None,
    category_key: str | None = None,
    stratify: bool = False,
) -> list[dict]:
    """``num_prompts`` rows taken round-robin from the sources (names or paths, or a
    recipe's ``eval.prompts`` entries with their offset, limit and category), so every source
    is present; ``category_key`` names the column files give each row's category in.
    ``stratify`` takes each source's rows round-robin over its categories too (a pool sorted
    by category, as MT-bench is, would otherwise give its first category only).

    Raises:
        DataError: a source whose slice holds no rows, or no usable prompt at all."""
    from specdec.data.prompts import source_label, source_rows

    if num_prompts < 1:
        raise ConfigError(f"num_prompts: must be >= 1, got {num_prompts}")
    sources = [PromptSource(s) if isinstance(s, str) else s for s in sources]
    pools = [source_rows(src, cache_dir, category_key) for src in sources]
    for src, pool in zip(sources, pools, strict=True):
        if not pool:
            raise DataError(f"prompt source {source_label(src)}: no rows in that slice")
        for row in pool:
            row.setdefault("category", row.get("category") or Path(src.source).stem)
    if stratify:
        pools = [interleave_categories(pool) for pool in pools]
    rows, i = [], 0
    while len(rows) < num_prompts and any(i < len(p) for p in pools):
        rows += [p[i] for p in pools if i < len(p)]
        i += 1
    if not rows:
        raise DataError(f"no usable prompts in {', '.join(sources)}")
    return rows[:num_prompts]


def interleave_categories(rows: list[dict]) -> list[dict]:
    """The rows round-robin over their categories (in order of first appearance), each
    category's rows in their own order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["category"], []).append(row)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def run_scoring(job: ScoreJob, settings: ScoreSettings) -> dict:
    """Score the job's drafter; write score.json and score.png; return the result."""
    from specdec.data.prompts import source_label
    from specdec.target import FrozenTarget

    settings.check()
    if job.num_prompts < 1:
        raise ConfigError(f"num_prompts: must be >= 1, got {job.num_prompts}")
    if job.certify < 0:
        raise ConfigError(f"--certify {job.certify}: expected >= 0")
    chosen = [x for x in (job.checkpoint, job.drafter, job.draft_model) if x]
    if len(chosen) != 1:
        raise ConfigError("give exactly one of --checkpoint, --drafter or --draft-model")
    if job.drafter:  # an unknown or trained family fails before any model is loaded
        _check_training_free(job.drafter)
    out = job.out_path
    if out.exists() and not job.force:  # e.g. the score training wrote beside a checkpoint
        raise ConfigError(f"{out} exists; pass --out PATH, or --force to replace it")
    above = next(a for a in out.absolute().parents if a.exists())  # where the path would start
    if not above.is_dir():
        raise ConfigError(f"--out {out}: {above} is a file, not a directory")
    target_spec = job.target
    if target_spec is None and job.checkpoint:
        target_spec = read_meta(job.checkpoint).get("target")
    target = FrozenTarget.load(
        target_spec or "smollm2-135m-instruct", dtype=job.dtype, cache_dir=job.cache_dir
    )
    drafter = build_drafter(job, target)
    # prompt rows take the warm-up on top of the requested count
    rows = load_prompts(job.prompts, job.num_prompts + settings.warmup_prompts, job.cache_dir)
    result = score(target.model, target.tokenizer, drafter, rows, settings)
    if job.certify:
        from specdec.scoring.certificate import sampling_certificate

        prompts = [encode_prompt(target.tokenizer, prompt_messages(r["messages"])) for r in rows]
        sampling = sampling_certificate(
            drafter.verifier(target.model), target.tokenizer, drafter,
            prompts[settings.warmup_prompts :][:4],
            job.certify, k=settings.k, temperature=settings.temperature or 1.0,
            top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed,
            target_forward=settings.target_forward,
        )  # fmt: skip
        cert = result.setdefault("certificate", {})
        cert["sampling"] = sampling
        cert["passed"] = cert.get("passed", True) and sampling["passed"]
    result["target"] = target.name
    result["prompts"] = [source_label(src) for src in job.prompts]
    write_json(out, result)
    result["plot"] = str(report.plot(result, out.with_suffix(".png")))
    result["json"] = str(out)
    return result
