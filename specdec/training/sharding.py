"""Sharded training (FSDP2): the drafter's trainable module split across the processes.

``accelerate launch`` with ``distributed_type: FSDP`` (``recipes/accelerate/fsdp.yaml``) asks
for it. accelerate turns FSDP on only for accelerators (on CPUs it would quietly train plain
DDP), so the trainer shards the module itself with torch's ``fully_shard``, the same way on
CUDA over NCCL and on CPUs over gloo, and accelerate only starts the processes. Each block of
every ``ModuleList`` (the decoder layers) is a unit of its own, the rest belongs to the root:
a process holds 1/N of every weight, gradient and Adam moment, and gathers a unit's weights
only while that unit runs. The frozen target is not sharded; every process holds it.
Trainable weights that live inside a borrowed model (Medusa-2's adapters, inside the adapted
backbone) cannot be split from it: the module names them (``replicated_parameters()``), every
process holds them whole, and their gradients are averaged across the processes after the
step's last micro-batch, as DDP does (:func:`reduce_replicated`).

A sharded forward is a collective: every process must run it. What one process does alone
with the drafter (saving and scoring a checkpoint) or each does on rows of its own (held-out
metrics, on-policy rollouts) runs on an unsharded replica instead, loaded first from the
gathered weights (:func:`refresh`, which every process calls). The replica holds weights only
(no gradients, no optimizer state): a process holds 1 + 3/N drafter-sized tensors where DDP
holds 4 (weights, gradients, two Adam moments).

The saved state holds the whole model and optimizer (gathered, written by the main process
beside accelerate's scheduler, counters and RNG states); on resume every process reads it
back and keeps its own shards.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

logger = logging.getLogger(__name__)

#: the environment variable ``accelerate launch`` sets for ``distributed_type: FSDP``
FSDP_ENV = "ACCELERATE_USE_FSDP"
#: the gathered model and optimizer, in the state directory
STATE_FILE = "sharded_state.pt"
#: the device meshes this process sharded over (:func:`release` lets go of their groups)
_meshes: list = []


def claim() -> bool:
    """Whether the launch asked for FSDP; the request is taken from accelerate, which then
    runs the processes as plain data parallel (the trainer shards the module itself)."""
    return os.environ.pop(FSDP_ENV, "").lower() == "true"


def release() -> None:
    """Let go of the process groups the device meshes hold, before the run destroys them.
    torch's DTensor caches keep a mesh (and through it its groups) alive after the model
    and optimizer are gone, so ``destroy_process_group`` would leave gloo's threads running
    into the interpreter's teardown, where they can abort a process whose run has ended."""
    for mesh in _meshes:
        getattr(mesh, "_pg_registry", {}).clear()
    _meshes.clear()


def check_precision(accelerator) -> None:
    """Refuse a loss scaler (fp16 on a GPU): the sharded path steps the optimizer itself and
    would clip and apply the scaled gradients.

    Raises:
        ConfigError: the accelerator scales the loss.
    """
    if getattr(accelerator, "scaler", None) is not None:
        from specdec.errors import ConfigError

        raise ConfigError(
            "train.mixed_precision: fp16 scales the loss, which sharded training does not "
            "undo; use bf16 under FSDP (or fp16 with DDP)"
        )


def shard(module: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
    """Shard ``module`` in place across all processes (each ``ModuleList`` block a unit, then
    the root; a block called through methods other than ``forward`` names them in
    ``sharded_methods``); under bf16/fp16 the units compute in that dtype and reduce
    gradients in fp32."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    _meshes.append(mesh)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    policy = MixedPrecisionPolicy(param_dtype=dtypes.get(precision), reduce_dtype=torch.float32)
    units = 1
    for blocks in [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]:
        for block in blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, mesh=mesh, mp_policy=policy)
                for name in getattr(block, "sharded_methods", ()):
                    register_fsdp_forward_method(block, name)
                units += 1
    kept = replicated(module)  # (a list: every process walks it in the same order)
    whole = set(kept)
    fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params=whole or None)
    with torch.no_grad():  # the replicated weights start as the main process's, as DDP's do
        for p in kept:
            torch.distributed.broadcast(p, src=0)
    total = sum(p.numel() for p in module.parameters())
    held = sum(p.to_local().numel() if p not in whole else p.numel() for p in module.parameters())
    logger.info(
        "FSDP: the drafter sharded across %d processes in %d units; this process holds %d of "
        "its %d parameters (%d replicated)",
        world,
        units,
        held,
        total,
        sum(p.numel() for p in whole),
    )
    return module


def replicated(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters ``module`` keeps whole on every process (its
    ``replicated_parameters()``; none by default)."""
    named = getattr(module, "replicated_parameters", None)
    return [p for p in named() if p.requires_grad] if named is not None else []


def reduce_replicated(module: torch.nn.Module) -> None:
    """Average the replicated parameters' gradients across the processes (every process calls
    it, once per optimizer step, after the last micro-batch's backward)."""
    params = replicated(module)
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= torch.distributed.get_world_size()
    for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = chunk.view_as(p).clone()


def refresh(replica: torch.nn.Module, sharded: torch.nn.Module) -> None:
    """Load the sharded module's gathered weights into the unsharded ``replica`` (every
    process calls it: gathering is a collective)."""
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    replica.load_state_dict(full)


@contextmanager
def no_sync(module: torch.nn.Module):
    """Accumulate this micro-batch's gradients locally; the last one reduces them all."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def clip_grad_norm(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients by their global norm (over the sharded and the replicated ones
    together); returns that norm."""
    kept = replicated(module)
    whole = set(kept)
    groups = (
        [p.grad for p in module.parameters() if p.grad is not None and p not in whole],
        [p.grad for p in kept if p.grad is not None],
    )
    norms = []
    for grads in groups:
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = max_norm / (float(total) + 1e-6)
    if not scale >= 1.0:  # as clip_grad_norm_: a NaN norm makes the gradients NaN too
        for grads in groups:
            for grad in grads:
                grad.mul_(scale)
    return total


def save(module, optimizer, state_dir: Path, is_main: bool) -> None:
    """Write the gathered model and optimizer into the temporary ``state_dir`` that is then
    swapped in whole (every process calls it: gathering is a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    if is_main:
        path = Path(state_dir) / STATE_FILE
        torch.save({"model": model_state, "optimizer": optim_state}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def load(module, optimizer, state_dir: Path) -> None:
    """Every process reads the gathered state back and keeps its own shards."""
    state = torch.load(Path(state_dir) / STATE_FILE, map_location="cpu", weights_only=True)
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
