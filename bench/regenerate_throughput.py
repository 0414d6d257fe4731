"""Throughput of target regeneration: backends, length-sorted vs unsorted batches, batch sizes,
workers.

Every configuration regenerates the same prompts greedily with :func:`specdec.data.regenerate`
in one process, after a dropped warm-up (the fastest of ``--repeats`` runs is kept), and the
table prints tokens/s relative to the first row (batch size 1 when asked for). Tokens are
counted the same way for every row
(new tokens up to and including EOS). The last column counts prompts whose response differs
from the first row (batched float arithmetic can flip a near-tie; expect 0 in float64, a few at
most otherwise).

    python bench/regenerate_throughput.py                      # tiny random Llama, in-process
    python bench/regenerate_throughput.py --model DIR --num-prompts 96 --max-new-tokens 128
    python bench/regenerate_throughput.py --config recipes/smollm2-135m/eagle3.yaml \
        --num-prompts 64 --max-new-tokens 128 --batch-sizes 16 --workers 1 2 4
    python bench/regenerate_throughput.py --config recipes/smollm2-135m/eagle3.yaml \
        --num-prompts 128 --max-new-tokens 128 --batch-sizes 16 32 64 --sorted-only
    python bench/regenerate_throughput.py --config recipes/smollm2-135m/eagle3.yaml \
        --num-prompts 128 --max-new-tokens 128 --batch-sizes 16 --sorted-only \
        --backends transformers compact

``--backends`` runs every batch size with each backend (``compact``: continuous batching with
that many slots, sorted by length).

``--workers`` adds rows for that many worker processes (at the largest batch size, sorted);
their seconds are the whole call's wall clock, the workers' start and model loading included.
``--config`` takes the target and the first training prompts (held-out ones removed) of a
recipe.

On a shared or busy CPU pass ``--threads`` (OpenMP threads that wait on each other swing the
timings by several times) and ``--repeats 3``.

``--model`` takes a local directory that ``from_pretrained`` loads (model and tokenizer with a
chat template); ``--prompts`` a JSONL file of ``{"id", "messages"}`` rows (default: synthetic
prompts whose lengths spread over two orders of magnitude, as real prompt sets do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specdec.config import load_recipe
from specdec.data.build import load_target_model, training_prompts
from specdec.data.chat import prompt_messages
from specdec.data.regenerate import load_regenerated, regenerate

TEXT = (
    "the target model drafts verifies tokens accepted rejected quickly slowly python function "
    "returns list of numbers please explain why how what when story robot paints sea night"
)

CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tiny_llama(hidden: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A seeded random 2-layer Llama with a byte-level BPE tokenizer and a ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=CHATML,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def synthetic_prompts(n: int, seed: int) -> list[dict]:
    """Prompts of 4 to ~400 words, log-uniformly spread."""
    rng = random.Random(seed)
    words = TEXT.split()
    prompts = []
    for i in range(n):
        length = int(4 * 100 ** rng.random())
        text = " ".join(rng.choice(words) for _ in range(length))
        prompts.append({"id": f"p{i}", "messages": [{"role": "user", "content": text}]})
    return prompts


def read_prompts(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": str(r["id"]), "messages": r["messages"]} for r in rows[:n]]


def recipe_prompts(config: Path, n: int) -> tuple[object, list[dict]]:
    """The recipe's target and ``n`` of its training prompts across its sources: those that
    ``data.max_prompts: n`` draws with the run's seed, in the order drawn."""
    recipe = load_recipe(str(config), [])
    rows = training_prompts(recipe)[0]
    random.Random(recipe.run.seed).shuffle(rows)
    rows = rows[:n]
    prompts = [{"id": r["id"], "messages": prompt_messages(r["messages"])} for r in rows]
    return recipe.target, prompts


def measure(model, tokenizer, prompts, max_new_tokens, **batching) -> tuple[float, int, list]:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        stats = regenerate(
            model, tokenizer, prompts, out, max_new_tokens=max_new_tokens, progress=False,
            **batching,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        rows = load_regenerated(out).to_list()
    return seconds, stats.new_tokens, [r["messages"][-1]["content"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", type=Path, help="local model directory (default: tiny)")
    parser.add_argument("--prompts", type=Path, help="JSONL of {id, messages} rows")
    parser.add_argument("--config", type=Path, help="a recipe: its target and training prompts")
    parser.add_argument("--workers", type=int, nargs="+", default=[], help="worker processes")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-batch-tokens", type=int, help="also run sorted, token-budgeted")
    parser.add_argument("--sorted-only", action="store_true", help="leave out unsorted batches")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float64"],
        help="the model's dtype (default: the recipe's target.dtype, else float32)",
    )  # fmt: skip
    parser.add_argument("--hidden", type=int, default=32, help="hidden size of the tiny model")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per config; fastest kept")
    parser.add_argument(
        "--backends", nargs="+", default=["transformers"], choices=["transformers", "compact"],
        help="regeneration backends, each at every batch size",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype or "float32")
    load = None
    if args.config:
        spec, prompts = recipe_prompts(args.config, args.num_prompts)
        spec = dataclasses.replace(spec, dtype=args.dtype or spec.dtype)
        load = partial(load_target_model, spec)
        model, tokenizer = load()
    elif args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, local_files_only=True
        ).eval()
    else:
        model, tokenizer = tiny_llama(args.hidden)
        model = model.to(dtype)
    if args.prompts:
        prompts = read_prompts(args.prompts, args.num_prompts)
    elif not args.config:
        prompts = synthetic_prompts(args.num_prompts, seed=0)
    lengths = sorted(
        len(tokenizer.apply_chat_template(p["messages"])["input_ids"]) for p in prompts
    )
    print(
        f"model {args.config or args.model or f'tiny llama (hidden {args.hidden})'} {model.dtype}, "
        f"{torch.get_num_threads()} threads, {len(prompts)} prompts of {lengths[0]}.."
        f"{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
        f"max_new_tokens {args.max_new_tokens}, greedy"
    )

    configs = [("batch 1", {"batch_size": 1})] if 1 in args.batch_sizes else []
    for size in (s for s in args.batch_sizes if s > 1):
        if not args.sorted_only:
            unsorted = {"batch_size": size, "sort_by_length": False}
            configs.append((f"batch {size} unsorted", unsorted))
        configs.append((f"batch {size} sorted", {"batch_size": size}))
    for size in (s for s in args.batch_sizes if "compact" in args.backends):
        configs.append((f"compact, {size} slots", {"batch_size": size, "backend": "compact"}))
    if "transformers" not in args.backends:
        configs = [c for c in configs if c[1].get("backend") == "compact"]
    if args.max_batch_tokens:
        big = max(args.batch_sizes) * 4
        budget = {"batch_size": big, "max_batch_tokens": args.max_batch_tokens}
        configs.append((f"sorted, <= {args.max_batch_tokens} tokens", budget))
    for workers in (w for w in args.workers if w > 1):
        if load is None:
            parser.error("--workers needs --config (workers load the recipe's target)")
        size = max(args.batch_sizes)
        configs.append(
            (
                f"batch {size}, {workers} workers",
                {"batch_size": size, "workers": workers, "load": load},
            )
        )

    measure(model, tokenizer, prompts[:4], 4, batch_size=4)  # warm-up, dropped
    results = []
    for name, kw in configs:
        runs = [measure(model, tokenizer, prompts, args.max_new_tokens, **kw)]
        runs += [measure(model, tokenizer, prompts, args.max_new_tokens, **kw)
                 for _ in range(args.repeats - 1)]  # fmt: skip
        results.append((name, *min(runs, key=lambda r: r[0])))
    base_seconds, base_tokens, base_texts = results[0][1:]
    base_rate = base_tokens / base_seconds
    print(f"{'config':<28}{'seconds':>9}{'tokens':>9}{'tok/s':>10}{'x first':>11}{'differ':>8}")
    for name, seconds, tokens, texts in results:
        rate = tokens / seconds
        differ = sum(a != b for a, b in zip(texts, base_texts, strict=True))
        print(
            f"{name:<28}{seconds:>9.2f}{tokens:>9d}{rate:>10.1f}"
            f"{rate / base_rate:>11.2f}{differ:>8d}"
        )


if __name__ == "__main__":
    main()
