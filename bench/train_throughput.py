"""Training tokens/s with the target online vs the target's forward-only tokens/s (the ceiling).

On the same micro-batches of a recipe's regenerated data: (a) the target's no-grad forward
alone, (b) a full training step (target forward, drafter forward and backward, optimizer).
Prints both throughputs, their ratio, and peak memory. Not a test: a measurement.

    python bench/train_throughput.py --config recipes/smollm2-135m/demo.yaml   # after `make demo`
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from specdec import drafters
from specdec.config import load_recipe
from specdec.data.build import load_training_data
from specdec.drafters.vocabulary import token_counts
from specdec.target import FrozenTarget
from specdec.training.loop import drafter_loss, micro_batch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="recipes/smollm2-135m/demo.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.config, args.overrides)
    target = FrozenTarget.from_config(recipe.target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    drafter = drafters.build(target, recipe.drafter, token_counts(dataset, target.vocab_size))
    model = drafter.module.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    pad = target.tokenizer.pad_token_id or 0
    size, group = recipe.train.batch_size, recipe.train.length_group
    lengths = torch.tensor([len(ids) for ids in dataset["input_ids"]])
    batches = [
        micro_batch(dataset, i, size, recipe.run.seed, pad, lengths, group)
        for i in range(args.steps + 1)
    ]
    batches = [{k: v.to(target.device) for k, v in b.items()} for b in batches]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])

    def forward_only(batch):
        with torch.no_grad():
            layers = drafter.required_target_layers
            target.forward(batch["input_ids"], batch["attention_mask"], hidden_layers=layers)

    def train_step(batch):  # the training loop's own loss, on one process
        counts = drafter.loss_masks(batch["loss_mask"]).sum(dim=(1, 2)).float()
        loss, _ = drafter_loss(drafter, model, target, batch, recipe.loss, counts)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    results = {}
    for name, step in (("target forward only", forward_only), ("training step", train_step)):
        step(batches[0])  # warm-up
        t0 = time.perf_counter()
        for batch in batches[1:]:
            step(batch)
        results[name] = tokens / (time.perf_counter() - t0)
    ceiling = results["target forward only"]
    print(
        f"{args.config} ({drafter.name}): {args.steps} micro-batches of {size}, {tokens} tokens "
        f"({tokens / sum(b['attention_mask'].numel() for b in batches[1:]):.0%} not padding), "
        f"threads {torch.get_num_threads()}, device {target.device}"
    )
    for name, tps in results.items():
        print(f"{name:<22}{tps:>10.1f} tokens/s{tps / ceiling:>8.2f}x of the ceiling")
    print(f"peak memory {peak_memory_mb(target.device):.0f} MiB")


if __name__ == "__main__":
    main()
