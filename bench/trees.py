"""Chains vs static trees vs dynamic trees for trained drafters, measured side by side in one run.

Every method decodes every held-out prompt with the same target session, interleaved per prompt
(plain decoding first), after warm-up prompts whose timings are dropped; the warm-up prompts
also calibrate each drafter's static tree (the rank paths its dynamic tree gets accepted) and
the target's verify cost profile v(m) is measured first, so each tree's budget is chosen from
it. Printed per method: tau, acceptance by depth, mean tree size, c, v, speedup over plain
decoding, the bound and the share of the round spent compacting the KV cache. Not a test: a
measurement.

    python bench/trees.py --checkpoint runs/smollm2-135m-eagle3/best \
        --checkpoint runs/smollm2-135m-draft_model/best --num-prompts 16 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.decoding.compact import target_session
from specdec.decoding.speculative import cheapest_verify_lengths, generate
from specdec.drafters.tree import TreeSpec
from specdec.scoring.command import load_prompts
from specdec.scoring.report import rates
from specdec.scoring.run import (
    ScoreSettings,
    calibrated_tree,
    cost_profile,
    encode_prompt,
    summarize,
)
from specdec.target import FrozenTarget, eos_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--checkpoint", action="append", required=True, help="a trained drafter")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--k", type=int, default=4, help="chain length and tree depth")
    parser.add_argument(
        "--confidence", type=float, default=0.4, help="the confidence stop of chains and trees"
    )
    parser.add_argument("--top-k", type=int, default=4, help="dynamic trees' expansion width")
    parser.add_argument("--max-nodes", type=int, default=24)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--warmup-prompts", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", default="mtbench,humaneval")
    parser.add_argument(
        "--budgets",
        help="comma-separated fixed tree sizes: compare the chain with dynamic trees of these "
        "sizes (full depth) instead of the cost-chosen trees",
    )
    parser.add_argument("--out", help="write the measurements as JSON here")
    args = parser.parse_args()

    target = FrozenTarget.load(args.target)
    loaded = {}
    for path in args.checkpoint:
        drafter = drafters.load(path, target)
        loaded[f"{drafter.name} ({Path(path).resolve().name})"] = drafter
    layers = sorted({i for d in loaded.values() for i in d.required_target_layers})
    session = target_session(target.model, "auto", layers)
    eos = eos_token_ids(target.model, target.tokenizer)
    rows = load_prompts(tuple(args.prompts.split(",")), args.num_prompts + args.warmup_prompts)
    encoded = [encode_prompt(target.tokenizer, prompt_messages(r["messages"])) for r in rows]
    warm = args.warmup_prompts

    profile = cost_profile(session, encoded[0], args.max_nodes + 1)
    costs = tuple(profile[m + 1] for m in range(args.max_nodes + 1))
    lengths = cheapest_verify_lengths(profile, args.k)
    dynamic = TreeSpec("dynamic", top_k=args.top_k, verify_costs=costs)
    # the chains' confidence stop, applied to the expansion of dynamic trees
    confident = TreeSpec(
        "dynamic", top_k=args.top_k, verify_costs=costs, confidence=args.confidence
    )

    def decode(drafter, tree, index: int, ids: list[int]):
        if drafter is not None:
            confidence = args.confidence if tree is None else 0.0
            drafter.configure("auto", confidence, tree)
        return generate(
            session,
            ids,
            drafter=drafter,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            eos_token_ids=eos,
            generator=torch.Generator().manual_seed(index),
            verify_lengths=lengths if tree is None and drafter is not None else None,
        )

    methods = {}
    for name, drafter in loaded.items():
        if args.budgets:
            methods[f"{name} chain"] = (drafter, None)
            for m in map(int, args.budgets.split(",")):
                fixed = TreeSpec("dynamic", top_k=args.top_k, budget=m)
                methods[f"{name} dynamic m={m}"] = (drafter, fixed)
            continue
        calibration = [decode(drafter, dynamic, i, ids) for i, ids in enumerate(encoded[:warm])]
        static = calibrated_tree(calibration, costs)
        methods[f"{name} chain"] = (drafter, None)
        methods[f"{name} static"] = (drafter, static)
        methods[f"{name} dynamic"] = (drafter, dynamic)
        methods[f"{name} dynamic, confidence"] = (drafter, confident)

    plain, runs = [], {m: [] for m in methods}
    for i, ids in enumerate(encoded):
        baseline = decode(None, None, i, ids)
        for method, (drafter, tree) in methods.items():
            gen = decode(drafter, tree, i, ids)
            if i >= warm:
                runs[method].append(gen)
        if i >= warm:
            plain.append(baseline)
        print(f"prompt {i + 1}/{len(encoded)} done", flush=True)

    results = {}
    for method, (_, tree) in methods.items():
        kind = "chain" if tree is None else tree.kind
        settings = ScoreSettings(k=args.k, tree=kind)
        results[method] = summarize(runs[method], plain, settings)
        results[method]["tree"] = tree.describe() if tree is not None else None
    print(table(results, profile))
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": profile, "methods": results}, indent=1))


def table(results: dict, profile: dict) -> str:
    head = f"{'method':<42} {'tau':>6} {'accept@depth':>22} {'size':>5} {'c':>6} {'v':>6} "
    head += f"{'speedup':>8} {'bound':>7} {'same':>5} {'keep%':>6}"
    lines = [head]
    for method, r in results.items():
        accept = rates(r["accept_rate_per_position"])
        lines.append(
            f"{method:<42} {r['tau']:>6.3f} {accept:>22} {r['mean_drafted']:>5.1f} "
            f"{r['c']:>6.3f} {r['v']:>6.3f} {r['speedup']:>7.3f}x {r['bound_speedup']:>6.3f}x "
            f"{r['greedy_match_rate']:>5.2f} {100 * r['keep_fraction']:>6.2f}"
        )
    ratio = " ".join(f"{m}:{t / profile[1]:.2f}" for m, t in profile.items())
    lines.append(f"verify cost v(m) = forward over m tokens / 1 token: {ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
