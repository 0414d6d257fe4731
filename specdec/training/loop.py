"""Distil a drafter against the frozen target: a short accelerate loop.

The target runs online under no_grad on every micro-batch; the drafter learns its
distribution on assistant tokens (DistillSpec, Zhou et al. 2024). One ``prepare``; gradient
accumulation with ``no_sync``; losses divided by the global count of unmasked tokens across
processes and accumulation steps, so N processes x A micro-batches give the same update as
one process with N*A micro-batches. The data order is a seeded permutation per epoch and the
data position is part of the saved state, so a resumed run continues the same run. Every
``save_every`` steps: the full state (for resuming), a drafter checkpoint, and its score from
the integrated decoder on held-out prompts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from specdec.config import Recipe, save_recipe
from specdec.errors import ConfigError
from specdec.losses import distill_loss, expected_acceptance, top1_agreement
from specdec.training.checkpoint import TrainState, check_same_recipe, replace_dir
from specdec.training.evaluate import score_checkpoint
from specdec.training.trackers import MetricsLog

logger = logging.getLogger(__name__)


def make_accelerator(recipe: Recipe) -> Accelerator:
    precision = recipe.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    trackers = list(recipe.train.trackers)
    if "wandb" in trackers:
        os.environ.setdefault("WANDB_MODE", "offline")  # online only when the user says so
    return Accelerator(
        # without CUDA, a torchrun-style launch (accelerate launch --multi_gpu) is DDP over gloo
        cpu=not torch.cuda.is_available(),
        mixed_precision=precision,
        log_with=trackers or None,
        project_dir=str(recipe.run_dir),
    )


def micro_batch(dataset, index: int, batch_size: int, seed: int, pad_id: int) -> dict:
    """Global micro-batch ``index`` of a seeded per-epoch permutation (last partial dropped)."""
    per_epoch = len(dataset) // batch_size
    epoch, j = divmod(index, per_epoch)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
    rows = dataset[order[j * batch_size : (j + 1) * batch_size].tolist()]
    width = max(len(ids) for ids in rows["input_ids"])
    batch = {"input_ids": [], "attention_mask": [], "loss_mask": []}
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        pad = width - len(ids)
        batch["input_ids"].append(ids + [pad_id] * pad)
        batch["attention_mask"].append([1] * len(ids) + [0] * pad)
        batch["loss_mask"].append(mask + [0] * pad)
    return {key: torch.tensor(value) for key, value in batch.items()}


def train(recipe: Recipe) -> dict:
    """Run the recipe: data, drafter, training, checkpoints with scores. Returns a summary."""
    from specdec.data.build import build_data, load_training_data
    from specdec.drafters.draft_model import DraftModelDrafter, build_draft_model
    from specdec.target import FrozenTarget

    if recipe.drafter.type != "draft_model":
        raise ConfigError(f"drafter.type: training '{recipe.drafter.type}' is not available yet")
    if not recipe.eval.prompts:
        raise ConfigError("eval.prompts: empty; checkpoints are scored on held-out prompts")
    cfg = recipe.train
    run_dir = recipe.run_dir
    accelerator = make_accelerator(recipe)
    main = accelerator.is_main_process
    state_dir = run_dir / "state"
    resuming = cfg.resume and state_dir.is_dir()
    if resuming:
        check_same_recipe(run_dir, recipe)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, run_dir / "recipe.yaml")
    set_seed(recipe.run.seed)

    target = FrozenTarget.from_config(recipe.target)
    target.model.to(accelerator.device)
    data_report = build_data(recipe, target) if main else None  # only one process writes
    accelerator.wait_for_everyone()
    dataset, _ = load_training_data(recipe, target.tokenizer)
    per_step = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
    if len(dataset) < per_step:
        raise ConfigError(
            f"train.batch_size: {len(dataset)} training rows cannot fill one step of {per_step}"
        )

    if recipe.drafter.from_pretrained:
        drafter = DraftModelDrafter.from_checkpoint(recipe.drafter.from_pretrained, target)
    else:
        counts = _token_counts(dataset, target.vocab_size)
        drafter = build_draft_model(target, recipe.drafter, counts)
    model = drafter.model
    model.train()
    optimizer = torch.optim.AdamW(
        drafter.trainable_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = get_scheduler(
        "constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=max(cfg.max_steps, 1),
    )
    # the scheduler is stepped once per optimizer step, by us: a prepared one would step once
    # per process, shortening the schedule under DDP
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state, scheduler)
    if resuming:
        accelerator.load_state(str(state_dir))
        logger.info("resumed %s at step %d", run_dir, state.step)
    log = MetricsLog(run_dir / "metrics.jsonl", accelerator, recipe, truncate_after=state.step)

    pad_id = target.tokenizer.pad_token_id or 0
    mix = recipe.loss.mix or {recipe.loss.name: 1.0}
    bar = tqdm(total=cfg.max_steps, initial=state.step, disable=not main, desc="train")
    window_tokens, window_start = 0, time.perf_counter()
    while state.step < cfg.max_steps:
        first = state.micro_batches + accelerator.process_index
        indices = [first + a * accelerator.num_processes for a in range(cfg.grad_accum)]
        batches = [
            {
                k: v.to(accelerator.device)
                for k, v in micro_batch(dataset, i, cfg.batch_size, recipe.run.seed, pad_id).items()
            }
            for i in indices
        ]
        # each prediction at t is scored where token t+1 is an assistant token
        local = sum(b["loss_mask"][:, 1:].sum() for b in batches).float()
        global_tokens = accelerator.reduce(local.clone(), "sum")
        per_process = global_tokens / accelerator.num_processes  # DDP averages gradients
        sums: dict[str, torch.Tensor] = {}
        for a, batch in enumerate(batches):
            sync = a == len(batches) - 1
            with accelerator.no_sync(model) if not sync else nullcontext():
                parts = _micro_step(
                    accelerator, model, target, drafter, batch, mix, recipe, per_process
                )
            for key, value in parts.items():
                sums[key] = sums.get(key, 0) + value
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if (cfg.max_grad_norm > 0)
            else None
        )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens = int(
            accelerator.reduce(
                torch.tensor(
                    sum(int(b["attention_mask"].sum()) for b in batches), device=accelerator.device
                ),
                "sum",
            )
        )
        state.step += 1
        state.micro_batches += cfg.grad_accum * accelerator.num_processes
        state.tokens += tokens
        window_tokens += tokens
        bar.update(1)
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            metrics = {k: float(accelerator.reduce(v, "sum")) for k, v in sums.items()}
            elapsed = time.perf_counter() - window_start
            metrics |= {
                "train/lr": scheduler.get_last_lr()[0],
                "train/tokens_per_second": window_tokens / elapsed,
                "train/epoch": state.micro_batches * cfg.batch_size / len(dataset),
            }
            if grad_norm is not None:
                metrics["train/grad_norm"] = float(grad_norm)
            log.write(state.step, metrics)
            bar.set_postfix(
                loss=f"{metrics['train/loss']:.3f}", acc=f"{metrics['train/acc@1']:.2f}"
            )
            window_tokens, window_start = 0, time.perf_counter()
        if state.step % cfg.save_every == 0 or state.step == cfg.max_steps:
            _save(accelerator, state_dir)
            if main:
                log.write(
                    state.step,
                    score_checkpoint(
                        accelerator.unwrap_model(model), drafter, target, recipe, state.step
                    ),
                )
                model.train()
            accelerator.wait_for_everyone()
    bar.close()
    log.close()
    accelerator.end_training()
    best = run_dir / "best.json"
    return {
        "run_dir": str(run_dir),
        "steps": state.step,
        "data": data_report,
        "best": json.loads(best.read_text()) if best.exists() else None,
        "scores": checkpoint_table(run_dir),
    }


def checkpoint_table(run_dir: Path) -> list[dict]:
    """tau, speedup and greedy identity of every scored checkpoint of a run, in step order."""
    rows = []
    for path in sorted((run_dir / "checkpoints").glob("step-*/score.json")):
        s = json.loads(path.read_text())
        rows.append(
            {
                "checkpoint": path.parent.name,
                "tau": s["tau"],
                "speedup": s["speedup"],
                "greedy_match_rate": s["greedy_match_rate"],
                "accept": s["accept_rate_per_position"],
            }
        )
    return rows


def _micro_step(accelerator, model, target, drafter, batch, mix, recipe, num_tokens) -> dict:
    """Forward target and drafter on one micro-batch, backpropagate its share of the loss."""
    with torch.no_grad():
        target_logits = target.forward(batch["input_ids"], batch["attention_mask"]).logits
    teacher = drafter.restrict(target_logits[:, :-1])  # [B, T-1, D]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    draft = logits[:, :-1].float()  # [B, T-1, D]
    mask = batch["loss_mask"][:, 1:].bool()
    loss, parts = distill_loss(
        draft,
        teacher,
        mask,
        mix=mix,
        temperature=recipe.loss.temperature,
        beta=recipe.loss.beta,
        teacher_top_k=recipe.loss.teacher_top_k,
        num_tokens=num_tokens,
    )
    accelerator.backward(loss)
    # per-token means of this micro-batch's share: summed over micro-batches and processes
    # (then divided by the process count) they are the step's global means
    share = mask.sum() / num_tokens / accelerator.num_processes
    out = {"train/loss": loss.detach() / accelerator.num_processes}
    out |= {f"train/loss/{k}": v.detach() / accelerator.num_processes for k, v in parts.items()}
    out["train/acc@1"] = top1_agreement(draft, teacher, mask) * share
    out["train/expected_accept"] = expected_acceptance(draft, teacher, mask) * share
    return out


def _save(accelerator: Accelerator, state_dir: Path) -> None:
    """``save_state`` into a temporary directory, then swap it in (atomic for a reader)."""
    tmp = state_dir.with_name("state.tmp")
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        replace_dir(tmp, state_dir)
    accelerator.wait_for_everyone()


def _token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """How often each target token is an assistant token: picks a reduced draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        kept = torch.tensor([t for t, m in zip(ids, mask, strict=True) if m], dtype=torch.long)
        counts += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    return counts
