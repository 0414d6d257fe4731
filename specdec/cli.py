"""The ``specdec`` command. Each subcommand parses its flags and calls one library function;
the entry scripts in ``train/`` and ``eval/`` call the same functions.

A :class:`~specdec.errors.SpecdecError` (bad recipe, missing file, checksum mismatch, ...) is
printed as one line and exits with status 2; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.errors import SpecdecError


def _score(args: argparse.Namespace) -> None:
    from specdec.scoring.command import ScoreJob, run_scoring
    from specdec.scoring.report import table
    from specdec.scoring.run import ScoreSettings

    job = ScoreJob(
        checkpoint=args.checkpoint,
        drafter=args.drafter,
        draft_model=args.draft_model,
        target=args.target,
        prompts=tuple(p for p in args.prompts.split(",") if p),
        num_prompts=args.num_prompts,
        out=args.out,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        max_ngram=args.max_ngram,
    )
    settings = ScoreSettings(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        warmup_prompts=args.warmup,
        shape_verify=not args.exact_verify_length,
    )
    result = run_scoring(job, settings)
    print(table(result))
    print(f"wrote {result['json']} and {result['plot']}")


def _fetch(args: argparse.Namespace) -> None:
    from specdec.data.prompts import load_prompt_rows
    from specdec.target import FrozenTarget

    target = FrozenTarget.load(args.target, cache_dir=args.cache_dir)
    print(f"target {target.name}: {target.num_layers} layers, vocab {target.vocab_size}")
    for name in filter(None, args.prompts.split(",")):
        rows = load_prompt_rows(name, cache=args.cache_dir)
        print(f"prompts {name}: {len(rows)} rows")


def _regenerate(args: argparse.Namespace) -> None:
    from specdec.data.build import describe_report, regenerate_from_recipe

    print(describe_report(regenerate_from_recipe(args.config, args.set)))


def _train(args: argparse.Namespace) -> None:
    from specdec.config import load_recipe
    from specdec.training.loop import train

    summary = train(load_recipe(args.config, args.overrides + args.set))
    for row in summary["scores"]:
        accept = " ".join(f"{a:.2f}" for a in row["accept"])
        print(
            f"{row['checkpoint']}  tau {row['tau']:.3f}  speedup {row['speedup']:.2f}x  "
            f"greedy identity {row['greedy_match_rate']}  accept@i {accept}"
        )
    print(f"run directory: {summary['run_dir']} ({summary['steps']} steps)")
    if summary.get("best"):
        best = summary["best"]
        print(
            f"best checkpoint: {best['path']} (tau {best['tau']:.3f}, "
            f"speedup {best['speedup']:.2f}x, greedy identity {best['greedy_match_rate']})"
        )


def _export(args: argparse.Namespace) -> None:
    from specdec.drafters.draft_model import read_meta
    from specdec.export import export
    from specdec.target import FrozenTarget

    meta = read_meta(args.checkpoint)
    target = FrozenTarget.load(
        args.target or meta.get("target") or "smollm2-135m-instruct", cache_dir=args.cache_dir
    )
    out = args.out or str(Path(args.checkpoint).resolve().parent.parent / "export" / args.format)
    print(f"exported and verified: {export(args.format, args.checkpoint, out, target)}")


def _check(args: argparse.Namespace) -> None:
    from specdec.config import load_recipe

    for path in args.recipes:
        load_recipe(path, args.set)
        print(f"ok  {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("score", help="measure a drafter with the speculative decoder")
    who = s.add_mutually_exclusive_group(required=True)
    who.add_argument("--checkpoint", help="a trained drafter checkpoint directory")
    who.add_argument("--drafter", help="a training-free drafter by name (prompt_lookup)")
    who.add_argument("--draft-model", help="any causal LM with the target's vocabulary")
    s.add_argument("--target", help="target model (default: the checkpoint's, else SmolLM2)")
    s.add_argument(
        "--prompts",
        default="mtbench,humaneval",
        help="comma-separated prompt sources: packaged names or .jsonl/.json files",
    )
    s.add_argument("--num-prompts", type=int, default=8, help="prompts scored (after warm-up)")
    s.add_argument("--warmup", type=int, default=1, help="warm-up prompts, not counted")
    s.add_argument("--k", type=int, default=4, help="draft tokens per round")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--max-ngram", type=int, default=3, help="prompt lookup's longest n-gram")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--exact-verify-length",
        action="store_true",
        help="verify exactly the drafted tokens instead of padding short drafts to "
        "the cheapest verify length of the measured cost profile",
    )
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--cache-dir", help="specdec cache (default $SPECDEC_CACHE or ~/.cache)")
    s.add_argument("--out", help="score.json path (default: beside the checkpoint, or ./)")
    s.set_defaults(func=_score)

    f = sub.add_parser("fetch", help="download, verify and cache the target and prompt sets")
    f.add_argument("--target", default="smollm2-135m-instruct")
    f.add_argument(
        "--prompts", default="alpaca_eval,arena_hard,ifeval,writingbench_en,mtbench,humaneval"
    )
    f.add_argument("--cache-dir")
    f.set_defaults(func=_fetch)

    d = sub.add_parser("data", help="build training data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    r = dsub.add_parser("regenerate", help="the target regenerates the responses of a recipe")
    r.add_argument("--config", required=True, help="recipe YAML")
    r.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides")
    r.set_defaults(func=_regenerate)

    t = sub.add_parser("train", help="distil a drafter from a recipe (under accelerate launch)")
    t.add_argument("--config", required=True, help="recipe YAML")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    t.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    t.set_defaults(func=_train)

    e = sub.add_parser("export", help="export a checkpoint for a serving engine or transformers")
    e.add_argument("--checkpoint", required=True, help="a drafter checkpoint directory")
    e.add_argument("--format", default="hf", help="hf (more formats arrive with their drafters)")
    e.add_argument("--out", help="export directory (default: <run dir>/export/<format>)")
    e.add_argument("--target", help="target model (default: the checkpoint's)")
    e.add_argument("--cache-dir")
    e.set_defaults(func=_export)

    c = sub.add_parser("check", help="validate recipes")
    c.add_argument("recipes", nargs="+")
    c.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # accelerate announces every file of every saved state at INFO
    logging.getLogger("accelerate").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        args.func(args)
    except SpecdecError as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
