"""What one training step of a recipe's drafter holds in memory, counted at a large target's
shapes on any machine, without the target's weights.

The target is built from its ``config.json`` on the meta device (no weights) but for its input
and output embeddings and final norm, which a drafter may borrow; its forward is stood in for by
random logits and hidden states of the right shapes, so the step is the training loop's own
(``drafter_loss``: the teacher, the drafter's S steps under the recipe's autocast, the loss and
its metrics). Every tensor the step keeps for its backward is counted once per storage, through
autograd's saved-tensor hooks (no backward runs; the process holds what one step keeps, about
12 GB for a row of 2,048 tokens of the Qwen3-8B head, 5.4 GB with its attention recomputed),
beside how much the process's resident memory grew. Printed beside it: the frozen target's weights
(its parameter count in its dtype), the drafter's weights, gradients and AdamW states (float32,
16 bytes a trainable parameter) and the peak resident memory of this process. Not counted:
short-lived tensors of the forward and backward (the largest is about one step's attention
scores), the target forward's own work, and allocator slack.

    python bench/train_memory.py --config recipes/qwen3-8b/eagle3.yaml \
        --target-config bench/configs/qwen3-8b.json --batch 1 --tokens 2048

Activations grow linearly with ``--batch``; run two ``--tokens`` to see how they grow with length.
Recipe overrides (``drafter.recompute_attention=false``) go before ``--tokens``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec import drafters
from specdec.config import load_recipe
from specdec.target import FrozenTarget, TargetOutput
from specdec.training.step import drafter_loss

GB = 1e9


class StandInTarget(FrozenTarget):
    """A target of the real shapes whose forward returns random logits and hidden states."""

    def forward(self, input_ids, attention_mask=None, *, hidden_layers=(), logits_at=None, **_):
        B, T = input_ids.shape
        rows = B * T if logits_at is None else int(logits_at.sum())
        dtype, width = self.dtype, self.hidden_size
        logits = torch.randn(rows, self.vocab_size, dtype=dtype)
        if logits_at is None:
            logits = logits.view(B, T, -1)
        states = {i: torch.randn(B, T, width, dtype=dtype) for i in hidden_layers}
        return TargetOutput(logits=logits, hidden_states=states)


def stand_in(config_path: str, dtype: torch.dtype) -> StandInTarget:
    config = AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    borrowed = [model.get_input_embeddings(), model.get_output_embeddings()]
    borrowed.append(getattr(model.get_decoder(), "norm", None))
    for module in filter(None, borrowed):
        module.to_empty(device="cpu")
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
    if config.get_text_config().tie_word_embeddings:
        model.tie_weights()
    tokenizer = SimpleNamespace(all_special_ids=[], added_tokens_decoder={})  # none to keep
    target = StandInTarget(model, tokenizer=tokenizer, name=config_path)
    target.parameter_count = parameters
    return target


class SavedBytes:
    """Counts each storage autograd saves for a backward once. The tensors stay kept, as
    training keeps them until its backward: a storage freed and its address reused would
    otherwise be taken for one already counted."""

    def __init__(self, skip: set[int]):
        self.seen, self.skip, self.total = set(), skip, 0

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.skip:
            self.seen.add(key)
            self.total += storage.nbytes()
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--config", required=True, help="a recipe (its drafter, loss, precision)")
    parser.add_argument("--target-config", required=True, help="the target's config.json")
    parser.add_argument("--batch", type=int, default=1, help="rows in the micro-batch")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048], help="row lengths")
    parser.add_argument(
        "--taught", type=float, default=0.5, help="share of each row trained on (its end)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not Path(args.target_config).is_file():
        parser.error(f"--target-config: no such file {args.target_config}")
    recipe = load_recipe(args.config, ["drafter.init_head_from_target=false", *args.overrides])
    dtype = getattr(torch, recipe.target.dtype)
    target = stand_in(args.target_config, dtype)
    counts = torch.arange(target.vocab_size, 0, -1)  # a draft vocabulary of the first ids
    torch.manual_seed(0)
    drafter = drafters.build(target, recipe.drafter, counts)
    drafter.prepare_training(recipe.drafter, target)
    model = drafter.module.train()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    target_params = target.parameter_count
    # the recipe's autocast as on a GPU (auto: one that supports bf16)
    precision = {"auto": "bf16"}.get(recipe.train.mixed_precision, recipe.train.mixed_precision)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def forward(*a, **k):
        with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
            return model(*a, **k)

    print(
        f"{args.config} ({drafter.name}) on {args.target_config}: target {target_params / 1e9:.2f}"
        f" B parameters in {recipe.target.dtype} = {target_params * dtype.itemsize / GB:.1f} GB;"
        f" drafter {trained / 1e9:.3f} B trainable parameters: weights, gradients and AdamW "
        f"states in float32 = {trained * 16 / GB:.1f} GB; autocast {precision}"
    )
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for tokens in args.tokens:
        ids = torch.randint(0, target.vocab_size, (args.batch, tokens))
        attention = torch.ones_like(ids)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, tokens - int(tokens * args.taught) :] = 1
        batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
        num = drafter.loss_masks(loss_mask).sum(dim=(1, 2)).float()
        saved = SavedBytes(skip)
        start, before = time.perf_counter(), psutil.Process().memory_info().rss
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            loss, _, _ = drafter_loss(drafter, forward, target, batch, recipe.loss, num)
        grown = psutil.Process().memory_info().rss - before
        seconds = time.perf_counter() - start
        print(
            f"batch {args.batch} x {tokens} tokens ({int(loss_mask.sum())} trained): kept for "
            f"the backward {saved.total / GB:.2f} GB ({saved.total / args.batch / GB:.2f} GB a "
            f"row; resident memory grew {grown / GB:.2f} GB); loss {loss.item():.2f}; "
            f"{seconds:.0f} s"
        )
        del loss  # and with it what the step kept
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak resident memory of this process {peak / GB:.1f} GB")
    print(json.dumps({"trainable": trained, "target_parameters": target_params}))


if __name__ == "__main__":
    main()
