"""From a recipe to training data: prompts (held-out prompts removed), the target's own answers.

The usual drafter recipe needs only prompts: the frozen target regenerates the responses
(self-distillation), so the drafter learns the distribution it will be verified against.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from datasets import Dataset

from specdec.config import PromptSource, Recipe, load_recipe, recipe_text, save_recipe
from specdec.data.chat import SFTStats, build_sft_dataset, prompt_messages
from specdec.data.prompts import source_rows, split_heldout
from specdec.data.regenerate import RegenerateStats, load_regenerated, regenerate
from specdec.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class DataReport:
    """What building the data did (printed by the command, kept in the run directory)."""

    dataset_dir: str
    num_prompts: int
    num_heldout_removed: int
    regenerate: dict
    sft: dict
    loss_tokens: int
    num_kept: int = 0  # rows of `responses: keep` sources, trained on as they are


def gather_prompts(sources: list[PromptSource], cache_dir: str | None) -> list[dict]:
    """Rows of every source, each with a unique ``id`` prefixed by its source and ``keep``
    set when the source trains on its own responses (``responses: keep``).

    Raises:
        DataError: a ``responses: keep`` source whose rows have no assistant turn.
    """
    rows = []
    for n, src in enumerate(sources):
        loaded = source_rows(src, cache_dir)
        keep = src.responses == "keep"
        if keep and not any(m["role"] == "assistant" for r in loaded for m in r["messages"]):
            raise DataError(
                f"data.prompts[{n}].responses: 'keep', but {src.source} has no assistant turns "
                "to train on; use responses: regenerate"
            )
        for i, row in enumerate(loaded):
            row["id"] = f"{Path(src.source).stem}:{row.get('id', i)}"
            row["keep"] = keep
            rows.append(row)
    return rows


def training_prompts(recipe: Recipe) -> tuple[list[dict], int]:
    """The recipe's training prompts, held-out evaluation prompts removed, sampled with the
    run's seed down to ``data.max_prompts``, in the sources' order (so a source added at the
    end appends its rows: the regenerated data and the teacher cache grow rather than start
    again). Returns the rows and how many were removed."""
    cache = recipe.target.cache_dir
    train = gather_prompts(recipe.data.prompts, cache)
    heldout = gather_prompts(recipe.eval.prompts, cache)
    kept = split_heldout(train, heldout)
    removed = len(train) - len(kept)
    order = list(range(len(kept)))
    random.Random(recipe.run.seed).shuffle(order)
    kept = [kept[i] for i in sorted(order[: recipe.data.max_prompts])]
    if not kept:
        raise DataError("data.prompts: no training prompts left after removing held-out ones")
    return kept, removed


def build_data(recipe: Recipe, target, progress: bool = True) -> DataReport:
    """Regenerate the answers of the recipe's training prompts with ``target``, resuming what
    is already on disk, and report what the training data holds. With regeneration off the
    rows' own responses are the training data."""
    rows, removed = training_prompts(recipe)
    out = dataset_dir(recipe)
    gen = recipe.data.regenerate
    prompts = [
        {"id": r["id"], "messages": prompt_messages(r["messages"]), "category": r.get("category")}
        for r in rows
        if not r["keep"]
    ]
    if not gen.enabled or not prompts:
        dataset, sft = load_training_data(recipe, target.tokenizer, rows)
        loss_tokens = sum(sum(m) for m in dataset["loss_mask"])
        return DataReport(str(out), len(rows), removed, {}, sft.as_dict(), loss_tokens, len(rows))
    stats: RegenerateStats = regenerate(
        target.model,
        target.tokenizer,
        prompts,
        out,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        batch_size=gen.batch_size,
        seed=gen.seed,
        shard_size=gen.shard_size,
        max_prompt_length=recipe.data.max_length,
        workers=gen.workers,
        backend=gen.backend,
        load=partial(load_target_model, recipe.target),
        progress=progress,
    )
    dataset, sft = load_training_data(recipe, target.tokenizer, rows)
    loss_tokens = sum(sum(m) for m in dataset["loss_mask"])
    kept = len(rows) - len(prompts)
    return DataReport(str(out), len(rows), removed, asdict(stats), sft.as_dict(), loss_tokens, kept)


def _source(row_id: str, by_target: bool) -> str:
    """``target/<source>`` or ``data/<source>``: who wrote the answer, and the prompt source."""
    return f"{'target' if by_target else 'data'}/{row_id.split(':', 1)[0]}"


def load_target_model(spec) -> tuple:
    """``(model, tokenizer)`` of the target ``spec`` describes (a regeneration worker's
    ``load``)."""
    from specdec.target import FrozenTarget

    target = FrozenTarget.from_config(spec)
    return target.model, target.tokenizer


def dataset_dir(recipe: Recipe) -> Path:
    return Path(recipe.data.dataset_dir or recipe.run_dir / "data")


def cache_dir(recipe: Recipe) -> Path:
    return Path(recipe.data.cache.dir or recipe.run_dir / "teacher-cache")


def cache_fingerprint(recipe: Recipe, target, dataset, layers) -> dict:
    """What the recipe's teacher cache must have been made for (target, the training rows
    ``dataset``, the drafter's ``layers``, the ``data.cache`` storage); computed once per run."""
    from specdec.data.cache import fingerprint

    return fingerprint(target, recipe.target, dataset, layers, recipe.data.cache)


def build_teacher_cache(recipe: Recipe, target, dataset, fp: dict, progress: bool = True) -> dict:
    """Cache the target's teacher for ``dataset`` into :func:`cache_dir`, resuming; returns
    the manifest."""
    from specdec.data.cache import build_cache

    out, size = cache_dir(recipe), recipe.data.cache.batch_size
    return build_cache(target, dataset, fp, out, size, progress, recipe_text(recipe))


def open_teacher_cache(recipe: Recipe, fp: dict, draft_ids=None):
    """The recipe's complete teacher cache, checked against ``fp``; its batches are over the
    drafter's vocabulary ``draft_ids``."""
    from specdec.data.cache_read import TeacherCache

    return TeacherCache(cache_dir(recipe), fp, draft_ids)


def load_training_data(
    recipe: Recipe, tokenizer, rows: list[dict] | None = None
) -> tuple[Dataset, SFTStats]:
    """The training conversations, tokenized with assistant-only loss masks, in the prompts'
    order: the target's regenerated answers and the rows of ``responses: keep`` sources, or
    with regeneration off every row's own responses. ``rows``: the recipe's
    :func:`training_prompts`, when the caller has them already. Besides ``input_ids`` and
    ``loss_mask``, each row's ``source`` (``target/<name>`` or ``data/<name>``: who wrote the
    answer, and the prompt source's name), ``target_written`` and ``id`` (the prompt's: a
    regenerated row and a ``keep`` row of one prompt share it)."""
    rows = training_prompts(recipe)[0] if rows is None else rows
    source = ", ".join(p.source for p in recipe.data.prompts)
    written = [False] * len(rows)
    if recipe.data.regenerate.enabled and not all(r["keep"] for r in rows):
        kept = [r for r in rows if r["keep"]]
        keeping = ", ".join(p.source for p in recipe.data.prompts if p.responses == "keep")
        source = f"{dataset_dir(recipe)}" + (f" + kept responses of {keeping}" if kept else "")
        regenerated = list(load_regenerated(dataset_dir(recipe)))
        # in the prompts' order, a kept row where its source stands: sources append rows
        place = {(r["id"], r["keep"]): i for i, r in enumerate(rows)}
        both = [(r, True) for r in regenerated] + [(r, False) for r in kept]
        both.sort(key=lambda pair: place.get((pair[0]["id"], not pair[1]), len(rows)))
        rows, written = [r for r, _ in both], [w for _, w in both]
    tagged = [
        {**row, "source": _source(row["id"], by_target), "target_written": by_target}
        for row, by_target in zip(rows, written, strict=True)
    ]
    return build_sft_dataset(
        tagged,
        tokenizer,
        recipe.data.max_length,
        recipe.data.overflow,
        recipe.data.require_assistant,
        source=str(source),
        carry=("source", "target_written", "id"),
    )


def split_rows(dataset, wanted: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows to train on and the held-out rows: ``wanted`` target-written rows picked with
    ``seed`` (at most a quarter of them; fewer is said in a warning). A row of the same prompt
    as a held-out one (its ``id``: a ``responses: keep`` row of the source that was also
    regenerated) is trained on by neither: its prompt would be trained on, its answer often
    near the held-out one."""
    written = torch.tensor(dataset["target_written"], dtype=torch.bool)
    candidates = written.nonzero().flatten()
    n = min(wanted, len(candidates) // 4)
    if n < wanted:
        logger.warning(
            "data.heldout_rows: %d asked, %d held out (a quarter of the %d target-written rows)",
            wanted, n, len(candidates),
        )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    heldout = candidates[torch.randperm(len(candidates), generator=generator)[:n]].sort().values
    train = torch.ones(len(dataset), dtype=torch.bool)
    train[heldout] = False
    if "id" in dataset.column_names and n:
        ids = dataset["id"]
        held = {ids[i] for i in heldout.tolist()}
        twins = [i for i, row_id in enumerate(ids) if row_id in held and train[i]]
        train[twins] = False
        if twins:
            logger.info("data.heldout_rows: %d rows of held-out prompts not trained on", len(twins))
    return train.nonzero().flatten(), heldout


def taught_rows(recipe: Recipe, dataset: Dataset, train_rows: torch.Tensor) -> Dataset:
    """The dataset with the positions that teach the drafter marked in ``loss_mask``: as
    tokenized (the assistant's tokens) under ``data.loss_on: assistant``; under ``all``, every
    token of the ``train_rows``, the held-out rows keeping their assistant-only masks, on which
    they are measured."""
    if recipe.data.loss_on == "assistant":
        return dataset
    train = set(train_rows.tolist())

    def widen(row: dict, index: int) -> dict:
        mask = row["loss_mask"]
        return {"loss_mask": [1] * len(mask) if index in train else mask}

    return dataset.map(widen, with_indices=True, desc="data.loss_on: all")


def cached_rows(recipe: Recipe, dataset: Dataset) -> Dataset:
    """The rows the teacher cache holds: every row as :func:`taught_rows` teaches it were none
    held out, so the cache does not depend on the held-out split (which a grown dataset draws
    anew, see :func:`split_rows`) and grows with the data; a held-out row reads the part of
    its cached teacher its own mask asks for."""
    return taught_rows(recipe, dataset, torch.arange(len(dataset)))


def regenerate_from_recipe(path: str, overrides: list[str]) -> DataReport:
    """``specdec data regenerate``: load the recipe and target, build the data, report."""
    from specdec.target import FrozenTarget

    recipe = load_recipe(path, overrides)
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, recipe.run_dir / "recipe.yaml")
    target = FrozenTarget.from_config(recipe.target)
    return build_data(recipe, target)


def cache_from_recipe(path: str, overrides: list[str], source: str | None = None) -> dict:
    """``specdec data cache``: the recipe's data (regenerated if it asks), its drafter's
    layers, then the teacher cache, built by the target or derived from the cache ``source``;
    returns what was cached and how fast."""
    import time

    from specdec import drafters
    from specdec.data.cache_derive import derive_cache, source_manifest
    from specdec.target import FrozenTarget

    recipe = load_recipe(path, overrides)
    if source is not None:
        source_manifest(Path(source))  # before the target loads
    target = FrozenTarget.from_config(recipe.target)
    build_data(recipe, target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    layers = drafters.for_recipe(recipe.drafter, target, dataset).required_target_layers
    dataset = cached_rows(recipe, dataset)
    start = time.perf_counter()
    fp = cache_fingerprint(recipe, target, dataset, layers)
    if source is None:
        manifest = build_teacher_cache(recipe, target, dataset, fp)
    else:
        text = recipe_text(recipe)
        manifest = derive_cache(Path(source), fp, cache_dir(recipe), recipe_text=text)
    manifest["seconds"] = time.perf_counter() - start
    manifest["dir"] = str(cache_dir(recipe))
    return manifest


def describe_cache(manifest: dict) -> str:
    """One line for people: where the cache is, what it holds, its size."""
    fp = manifest["fingerprint"]
    per_k = manifest["bytes"] / max(manifest["tokens"], 1) * 1000
    return (
        f"teacher cache {manifest['dir']}: {fp['rows']} rows, {manifest['tokens']} tokens "
        f"({manifest['teacher_positions']} with a teacher), layers {fp['layers']}, top-k "
        f"{fp['top_k'] or 'full'}, {fp['dtype']}: {manifest['bytes'] / 1e6:.1f} MB "
        f"({per_k / 1e6:.2f} MB per 1,000 tokens); {manifest['seconds']:.1f} s this run"
    )


def describe_report(report: DataReport) -> str:
    """Two lines for people: what was regenerated, how fast, and what training will see."""
    regen = report.regenerate
    if not regen:
        return (
            f"prompts {report.num_prompts} with their own responses (no regeneration); "
            f"training rows {report.sft['kept']}, {report.loss_tokens} assistant tokens"
        )
    return (
        f"prompts {report.num_prompts} (held-out removed: {report.num_heldout_removed}; "
        f"{report.num_kept} keep their own responses); regenerated {regen['num_done']} now, "
        f"{regen['num_skipped']} reused from disk; "
        f"{regen['new_tokens']} new tokens in {regen['seconds']:.1f} s "
        f"({regen['tokens_per_second']:.1f} tokens/s, {regen.get('workers', 1)} process(es)); "
        f"{regen['truncated']} hit max_new_tokens\n"
        f"training rows {report.sft['kept']} (truncated {report.sft['truncated']}, dropped "
        f"{report.sft['dropped']}), {report.loss_tokens} assistant tokens -> {report.dataset_dir}"
    )
