"""A trained drafter's own network in each decoding dtype, measured side by side in one run.

Every checkpoint drafts chains on every held-out prompt once per draft forward (``float32``,
``float16``, ``transformers``: ``eval.draft_forward``), interleaved per prompt with plain
decoding first, through the same target session, after warm-up prompts whose timings are
dropped. Printed per checkpoint and forward: tau, acceptance by position, c (a drafted token's
cost in target steps), v, the speedup over plain decoding, the bound and greedy identity.
A float16 draft changes q a little (and so, at times, a drafted token), never the output:
decoding stays exact. Not a test: a measurement.

    python bench/draft_forward.py --checkpoint runs/smollm2-135m-mtp/best --k 2 \
        --forwards float32,float16 --num-prompts 10 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.decoding.compact import target_session
from specdec.decoding.speculative import generate
from specdec.drafters.base import FORWARDS
from specdec.scoring.command import load_prompts
from specdec.scoring.report import rates
from specdec.scoring.run import ScoreSettings, encode_prompt, summarize
from specdec.target import FrozenTarget, eos_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--checkpoint", action="append", required=True, help="a trained drafter")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--forwards", default="float32,float16", help="comma-separated")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--confidence", type=float, default=0.0, help="the chains' confidence stop")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--warmup-prompts", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", default="mtbench,humaneval")
    parser.add_argument("--out", help="write the measurements as JSON here")
    args = parser.parse_args()
    forwards = args.forwards.split(",")
    unknown = [f for f in forwards if f not in FORWARDS]
    if unknown:
        parser.error(f"--forwards: {unknown[0]!r} is not one of {', '.join(FORWARDS)}")

    target = FrozenTarget.load(args.target)
    methods = {}
    for path in args.checkpoint:
        drafter = drafters.load(path, target)
        for forward in forwards:
            methods[f"{drafter.name} ({Path(path).resolve().name}) {forward}"] = (drafter, forward)
    layers = sorted({i for d, _ in methods.values() for i in d.required_target_layers})
    session = target_session(target.model, "auto", layers)
    eos = eos_token_ids(target.model, target.tokenizer)
    rows = load_prompts(tuple(args.prompts.split(",")), args.num_prompts + args.warmup_prompts)
    encoded = [encode_prompt(target.tokenizer, prompt_messages(r["messages"])) for r in rows]

    def decode(drafter, forward, index: int, ids: list[int]):
        if drafter is not None:
            drafter.configure(forward, args.confidence)
        return generate(
            session, ids, drafter=drafter, k=args.k, max_new_tokens=args.max_new_tokens,
            eos_token_ids=eos, generator=torch.Generator().manual_seed(index),
        )  # fmt: skip

    plain, runs = [], {m: [] for m in methods}
    for i, ids in enumerate(encoded):
        baseline = decode(None, None, i, ids)
        for method, (drafter, forward) in methods.items():
            gen = decode(drafter, forward, i, ids)
            if i >= args.warmup_prompts:
                runs[method].append(gen)
        if i >= args.warmup_prompts:
            plain.append(baseline)
        print(f"prompt {i + 1}/{len(encoded)} done", flush=True)

    settings = ScoreSettings(k=args.k)
    results = {m: summarize(runs[m], plain, settings) for m in methods}
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def table(results: dict) -> str:
    head = f"{'drafter and forward':<44} {'tau':>6} {'accept@i':>18} {'c':>6} {'v':>6} "
    head += f"{'speedup':>8} {'bound':>7} {'same':>5}"
    lines = [head]
    for method, r in results.items():
        lines.append(
            f"{method:<44} {r['tau']:>6.3f} {rates(r['accept_rate_per_position']):>18} "
            f"{r['c']:>6.3f} {r['v']:>6.3f} {r['speedup']:>7.3f}x {r['bound_speedup']:>6.3f}x "
            f"{r['greedy_match_rate']:>5.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
