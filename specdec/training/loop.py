"""Distil a drafter against the frozen target: a short accelerate loop.

The target runs online under no_grad on every micro-batch, or its logits and hidden states are
read from a teacher cache (``data.teacher: cache``, :mod:`specdec.data.cache`); the drafter
learns its distribution on assistant tokens (DistillSpec, Zhou et al. 2024). One
``prepare`` (DDP), or the drafter sharded by :mod:`specdec.training.sharding` (FSDP);
gradient accumulation with ``no_sync``; losses divided by the global count of
unmasked tokens across processes and accumulation steps, so N processes x A micro-batches
give the same update as one process with N*A micro-batches. The data order is a seeded
permutation per epoch and the data position is part of the saved state, so a resumed run
continues the same run. With ``data.on_policy`` a share of the micro-batches are the drafter's
own continuations of training prompts (:mod:`specdec.data.onpolicy`), refreshed every N steps
and saved with the state. Every ``save_every`` steps: the full state (for resuming), a drafter
checkpoint, and its score from the integrated decoder on held-out prompts; a run killed
anywhere in between resumes to the same state with every checkpoint scored.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.config import Recipe
from specdec.files import replace_dir
from specdec.training import sharding
from specdec.training.checkpoint import refresh_best
from specdec.training.evaluate import checkpoint_table, score_checkpoint
from specdec.training.heldout import heldout_metrics
from specdec.training.setup import Run, setup
from specdec.training.step import drafter_loss, micro_batch, step_counts
from specdec.training.trackers import MetricsLog

logger = logging.getLogger(__name__)


def train(recipe: Recipe) -> dict:
    """Run the recipe: data, drafter, training, checkpoints with scores. Returns a summary."""
    run = setup(recipe)
    accelerator = run.accelerator
    steps(run)
    best = recipe.run_dir / "best.json"
    summary = {
        "run_dir": str(recipe.run_dir),
        "steps": run.state.step,
        "seconds": run.state.seconds,
        "data": run.data_report,
        "best": json.loads(best.read_text()) if best.exists() else None,
        "scores": checkpoint_table(recipe.run_dir),
        "main_process": accelerator.is_main_process,
    }
    del run
    close(accelerator)
    return summary


def steps(run: Run) -> None:
    """The training steps, from the run's state to ``train.max_steps`` or the time budget,
    with their logs, saves and scores."""
    recipe = run.recipe
    cfg, state, accelerator = recipe.train, run.state, run.accelerator
    log = MetricsLog(recipe.run_dir / "metrics.jsonl", accelerator, recipe, state.step)
    bar = tqdm(
        total=cfg.max_steps,
        initial=state.step,
        disable=not accelerator.is_main_process,
        desc="train",
    )
    out_of_time = spend(run, 0.0)  # a resumed run may have spent its budget
    saved = _save_due(cfg, state.step) or out_of_time
    if state.step > 0 and saved and not _scored(recipe.run_dir, state.step):
        score_saved(run, log)  # the run was killed between its state and its checkpoint's score
    elif state.step > 0 and accelerator.is_main_process:
        refresh_best(recipe.run_dir)  # or between a score and best
    window_tokens, window_start, last = 0, time.perf_counter(), None
    while state.step < cfg.max_steps and not out_of_time:
        tick = clock()
        if run.pool is not None and run.pool.due(state.step):
            drafter, _ = run.decoding()
            run.pool.refresh(
                run.target, drafter, run.dataset, run.train_rows, state.step, accelerator
            )
        before = state.seconds
        sums, grad_norm, tokens = optimizer_step(run, _logged(run, last))
        out_of_time = spend(run, clock() - tick)
        last = state.seconds - before  # the same on every process
        window_tokens += tokens
        bar.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps or out_of_time:
            metrics = {k: float(accelerator.reduce(v, "sum")) for k, v in sums.items()}
            metrics |= {
                "train/lr": run.scheduler.get_last_lr()[0],
                "train/tokens_per_second": window_tokens / (time.perf_counter() - window_start),
                "train/epoch": state.micro_batches * cfg.batch_size / len(run.train_rows),
                "train/seconds": state.seconds,
            }
            if grad_norm is not None:
                metrics["train/grad_norm"] = float(grad_norm)
            metrics |= run.by_source.metrics(accelerator)
            if run.pool is not None:
                metrics |= run.pool.stats
                run.pool.stats = {}
            metrics |= heldout_metrics(run, cfg.batch_size)
            log.write(state.step, metrics)
            bar.set_postfix(
                loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/acc@1']:.2f}"
            )
            window_tokens, window_start = 0, time.perf_counter()
        if _save_due(cfg, state.step) or out_of_time:
            save_and_score(run, log)
    bar.close()
    log.close()


def close(accelerator) -> None:
    """End a run's processes cleanly: every process done, the references to the process
    group dropped (the prepared model's, the FSDP device meshes'), then the group destroyed
    while the interpreter is whole. A group still referenced outlives
    ``destroy_process_group`` and is torn down with the interpreter, where gloo's threads can
    abort a process whose run has finished."""
    accelerator.wait_for_everyone()
    sharding.release()
    accelerator.free_memory()  # accelerate's own references, then a collection
    accelerator.end_training()


def _logged(run: Run, last: float | None) -> bool:
    """Whether the coming step will be logged, so computes every metric: every
    ``train.log_every`` steps, the last of ``train.max_steps``, and any step that may spend the
    time budget: the first of a run or resumption (``last`` None), or one with no more than
    three times the previous step's ``last`` seconds left. Only what every process shares
    decides (their metrics are reduced key by key). A step that overruns that margin and ends
    the budget is logged with the loss and the first step's accuracy only."""
    cfg, step = run.recipe.train, run.state.step + 1
    budget = cfg.max_minutes
    near_end = budget is not None and (last is None or run.state.seconds + 3 * last >= 60 * budget)
    return step % cfg.log_every == 0 or step == cfg.max_steps or near_end


def optimizer_step(run: Run, detail: bool = True) -> tuple[dict, torch.Tensor | None, int]:
    """One optimizer step over this process's share of the step's micro-batches.

    Returns the per-process metric sums (every metric with ``detail``, else the loss and
    first-step accuracy only), the gradient norm and the step's input tokens (all processes).
    """
    recipe, accelerator, state = run.recipe, run.accelerator, run.state
    cfg, n = recipe.train, accelerator.num_processes
    pad_id = run.target.tokenizer.pad_token_id or 0
    slots = cfg.grad_accum * n
    # the first `mixed` micro-batches of the step are the drafter's own continuations
    policy_first, mixed = run.pool.split(state.step, slots) if run.pool else (0, 0)
    batches = []
    for a in range(cfg.grad_accum):
        j = a * n + accelerator.process_index  # this micro-batch's slot in the step
        if j < mixed:
            pool = run.pool
            batch = micro_batch(
                pool.dataset, policy_first + j, cfg.batch_size, pool.batch_seed, pad_id
            )
            batch["rows"] = torch.full_like(batch["rows"], len(run.dataset))  # POLICY_SOURCE
        else:
            batch = micro_batch(
                run.dataset,
                state.micro_batches + j - mixed,
                cfg.batch_size,
                recipe.run.seed,
                pad_id,
                run.lengths,
                cfg.length_group,
                run.cache,
                run.train_rows,
            )
        batches.append({k: v.to(accelerator.device) for k, v in batch.items()})
    # per draft step: the global count of positions it is trained on
    per_process = step_counts(run.drafter, batches, accelerator)
    sums: dict[str, torch.Tensor] = {}
    for a, batch in enumerate(batches):
        last = a == len(batches) - 1
        with nullcontext() if last else _no_sync(run):
            parts = _micro_step(run, batch, per_process, detail)
        for key, value in parts.items():
            sums[key] = sums.get(key, 0) + value
    if run.replica is not None:  # FSDP: weights kept whole get DDP's averaged gradients
        sharding.reduce_replicated(run.model)
    grad_norm = None
    if cfg.max_grad_norm > 0 and run.replica is not None:
        grad_norm = sharding.clip_grad_norm(run.model, cfg.max_grad_norm)
    elif cfg.max_grad_norm > 0:
        grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    local_tokens = torch.tensor(sum(int(b["attention_mask"].sum()) for b in batches))
    tokens = int(accelerator.reduce(local_tokens.to(accelerator.device), "sum"))
    state.step += 1
    state.micro_batches += slots - mixed
    state.tokens += tokens
    return sums, grad_norm, tokens


def save_and_score(run: Run, log: MetricsLog) -> None:
    """Save the full state (for resuming), then the drafter as a checkpoint with its score
    (:func:`score_saved`). The state comes first: a run killed in between resumes at this
    step and scores it then."""
    _save(run, run.recipe.run_dir / "state")
    score_saved(run, log)


def score_saved(run: Run, log: MetricsLog) -> None:
    """On the main process save the drafter as ``checkpoints/step-N`` and score it; every
    process waits for the score."""
    accelerator = run.accelerator
    drafter, model = run.decoding()
    if accelerator.is_main_process:
        metrics = score_checkpoint(model, drafter, run.target, run.recipe, run.state.step)
        log.write(run.state.step, metrics)
        model.train()
    accelerator.wait_for_everyone()


#: the training clock (a test may replace it)
clock = time.perf_counter


def spend(run: Run, seconds: float) -> bool:
    """Add ``seconds`` of training to the run's clock; whether ``train.max_minutes`` is spent.
    Under several processes the slowest one's clock counts, so all stop at the same step."""
    state, budget = run.state, run.recipe.train.max_minutes
    state.seconds += seconds
    if budget is None:
        return False
    clocks = torch.tensor([state.seconds], dtype=torch.float64, device=run.accelerator.device)
    state.seconds = float(run.accelerator.gather(clocks).max())
    return state.seconds >= 60 * budget


def _save_due(cfg, step: int) -> bool:
    return step % cfg.save_every == 0 or step == cfg.max_steps


def _scored(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step-{step:06d}" / "score.json").is_file()


def _micro_step(run: Run, batch: dict, num_tokens: torch.Tensor, detail: bool) -> dict:
    """Forward target and drafter on one micro-batch, backpropagate its share of the loss."""
    n = run.accelerator.num_processes
    loss, metrics, (agree, count) = drafter_loss(
        run.drafter, run.model, run.target, batch, run.recipe.loss, num_tokens, n, detail
    )
    run.by_source.add(batch["rows"], agree, count)
    run.accelerator.backward(loss)
    return metrics


def _no_sync(run: Run):
    """Gradients of this micro-batch kept local (the step's last one reduces them)."""
    if run.replica is not None:
        return sharding.no_sync(run.model)
    return run.accelerator.no_sync(run.model)


def _save(run: Run, state_dir: Path) -> None:
    """``save_state`` (and under FSDP the gathered model and optimizer) into a temporary
    directory, then swap it in (atomic for a reader)."""
    accelerator = run.accelerator
    tmp = state_dir.with_name("state.tmp")
    accelerator.save_state(str(tmp))
    if run.replica is not None:
        sharding.save(run.model, run.optimizer, tmp, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        replace_dir(tmp, state_dir)
    accelerator.wait_for_everyone()
