"""Training tokens/s with the target online vs with its teacher read from the cache.

On the same micro-batches of a recipe's data, one process, interleaved in blocks so both see
the same machine: (a) the target's no-grad forward alone (what the online step cannot beat),
(b) a training step with the target online (target forward, drafter forward and backward,
optimizer), (c) the same step with the teacher read from the recipe's teacher cache (reading
and unpacking the shards is inside the timing); with ``--every-row`` also (d) the cache step
with the drafter computing every row, not only the rows a step trains (what skipping the
others saves); with ``--bf16`` also (e) the cache step with the drafter's forward under bfloat16
autocast (what ``train.mixed_precision: bf16`` does; ``auto`` takes it on a GPU that supports it
and on a CPU with bfloat16 units); with ``--every-metric`` also (f) the cache step computing every
training metric, as the loop does on the steps it logs (the others compute the loss and the
first step's accuracy only). Prints tokens/s, the cache's speedup over online, and peak
memory; with ``--profile N``, then where N cache steps spend their time, by operator. Not a
test: a measurement.

    python bench/train_throughput.py --config recipes/smollm2-135m/eagle3.yaml --steps 12

The recipe's cache is built first when it is missing (``specdec data cache`` does the same).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from specdec import drafters
from specdec.config import load_recipe
from specdec.data.build import (
    build_teacher_cache,
    cache_fingerprint,
    cached_rows,
    load_training_data,
    open_teacher_cache,
    split_rows,
    taught_rows,
)
from specdec.target import FrozenTarget
from specdec.training.setup import adamw
from specdec.training.step import drafter_loss, micro_batch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--config", default="recipes/smollm2-135m/demo.yaml")
    parser.add_argument("--steps", type=int, default=12, help="micro-batches timed per mode")
    parser.add_argument("--block", type=int, default=4, help="micro-batches per turn of a mode")
    parser.add_argument(
        "--every-row", action="store_true", help="also time the cache step computing every row"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="also time the cache step under bf16 autocast"
    )
    parser.add_argument(
        "--every-metric", action="store_true",
        help="also time the cache step computing every metric (the loop's logged steps)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="afterwards, profile N cache steps and print the operators that cost most",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.config, args.overrides)
    target = FrozenTarget.from_config(recipe.target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    torch.manual_seed(recipe.run.seed)
    drafter = drafters.for_recipe(recipe.drafter, target, dataset)
    layers = drafter.required_target_layers
    cached = cached_rows(recipe, dataset)  # what training caches
    fp = cache_fingerprint(recipe, target, cached, layers)
    build_teacher_cache(recipe, target, cached, fp)  # nothing to do when it is there
    cache = open_teacher_cache(recipe, fp, drafter.teacher_vocab)
    train_rows = split_rows(dataset, recipe.data.heldout_rows, recipe.run.seed)[0]
    dataset = taught_rows(recipe, dataset, train_rows)  # data.loss_on, as training marks it
    model = drafter.module.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trained, 1e-5, 0.0, target.device)  # the training loop's
    pad = target.tokenizer.pad_token_id or 0
    size, group = recipe.train.batch_size, recipe.train.length_group
    lengths = torch.tensor([len(ids) for ids in dataset["input_ids"]])

    def batch(i: int, with_cache: bool) -> dict:
        b = micro_batch(
            dataset, i, size, recipe.run.seed, pad, lengths, group, cache if with_cache else None
        )
        return {k: v.to(target.device) for k, v in b.items()}

    def forward_only(i: int) -> int:
        b = batch(i, False)
        with torch.no_grad():
            target.forward(b["input_ids"], b["attention_mask"], hidden_layers=layers)
        return int(b["attention_mask"].sum())

    def every_row(*args, at=None):  # the drafter's forward told nothing of the rows read
        return [step[at] for step in model(*args)]

    def bf16(*args, **kwargs):  # the drafter's forward as the accelerator autocasts it
        with torch.autocast(target.device.type, dtype=torch.bfloat16):
            return model(*args, **kwargs)

    def train_step(i: int, with_cache: bool, forward=model, detail=False) -> int:
        b = batch(i, with_cache)
        counts = drafter.loss_masks(b["loss_mask"]).sum(dim=(1, 2)).float()
        # the loop's own loss; as on its unlogged steps, no metric but the first step's accuracy
        loss, _, _ = drafter_loss(drafter, forward, target, b, recipe.loss, counts, detail=detail)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(b["attention_mask"].sum())

    modes = {
        "target forward only": forward_only,
        "training step, online": lambda i: train_step(i, False),
        "training step, cache": lambda i: train_step(i, True),
    }
    if args.every_row:
        modes["cache, every row"] = lambda i: train_step(i, True, every_row)
    if args.bf16:
        modes["cache, bf16 autocast"] = lambda i: train_step(i, True, bf16)
    if args.every_metric:
        modes["cache, every metric"] = lambda i: train_step(i, True, detail=True)
    seconds = dict.fromkeys(modes, 0.0)
    tokens = dict.fromkeys(modes, 0)
    for step in modes.values():
        step(0)  # warm-up
    for start in range(1, args.steps + 1, args.block):
        for name, step in modes.items():
            for i in range(start, min(start + args.block, args.steps + 1)):
                t0 = time.perf_counter()
                tokens[name] += step(i)
                seconds[name] += time.perf_counter() - t0
    rate = {name: tokens[name] / seconds[name] for name in modes}
    fp = cache.fp
    print(
        f"{args.config} ({drafter.name}): {args.steps} micro-batches of {size} per mode, "
        f"{tokens['target forward only']} tokens each; cache top-k {fp['top_k'] or 'full'} "
        f"{fp['dtype']}, layers {fp['layers']}; threads {torch.get_num_threads()}, "
        f"device {target.device}"
    )
    online = rate["training step, online"]
    for name, tps in rate.items():
        print(f"{name:<24}{tps:>10.1f} tokens/s{tps / online:>8.2f}x of online training")
    if args.bf16:
        ratio = rate["cache, bf16 autocast"] / rate["training step, cache"]
        print(f"bf16 autocast against float32, both from the cache: {ratio:.2f}x")
    print(f"peak memory (all modes, one process) {peak_memory_mb(target.device):.0f} MiB")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for i in range(args.steps + 1, args.steps + 1 + args.profile):
                train_step(i, True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
