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

#: the scoring flags' values when neither the command line nor a recipe gives them
SCORE_DEFAULTS = {
    "target": None, "prompts": "mtbench,humaneval", "num_prompts": 8, "warmup": 1, "k": 4,
    "temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 128, "max_ngram": 3,
    "seed": 0, "dtype": "float32", "cache_dir": None, "draft_forward": "auto",
    "draft_confidence": 0.0, "target_forward": "auto",
}  # fmt: skip


def _score(args: argparse.Namespace) -> None:
    from specdec.scoring.command import ScoreJob, run_scoring
    from specdec.scoring.report import table
    from specdec.scoring.run import ScoreSettings

    base = dict(SCORE_DEFAULTS)
    drafter = args.drafter
    if args.config:
        recipe_values, recipe_drafter = _recipe_score_values(args.config, args.set)
        base.update(recipe_values)
        if not (args.checkpoint or args.drafter or args.draft_model):
            drafter = recipe_drafter
    v = {key: base[key] if getattr(args, key) is None else getattr(args, key) for key in base}
    job = ScoreJob(
        checkpoint=args.checkpoint,
        drafter=drafter,
        draft_model=args.draft_model,
        target=v["target"],
        prompts=tuple(p for p in v["prompts"].split(",") if p),
        num_prompts=v["num_prompts"],
        out=args.out,
        cache_dir=v["cache_dir"],
        dtype=v["dtype"],
        max_ngram=v["max_ngram"],
    )
    settings = ScoreSettings(
        k=v["k"],
        max_new_tokens=v["max_new_tokens"],
        temperature=v["temperature"],
        top_k=v["top_k"],
        top_p=v["top_p"],
        seed=v["seed"],
        warmup_prompts=v["warmup"],
        shape_verify=not args.exact_verify_length,
        draft_forward=v["draft_forward"],
        draft_confidence=v["draft_confidence"],
        target_forward=v["target_forward"],
    )
    result = run_scoring(job, settings)
    print(table(result))
    print(f"wrote {result['json']} and {result['plot']}")


def _recipe_score_values(path: str, overrides: list[str]) -> tuple[dict, str]:
    """A recipe's target, eval settings and drafter type, as scoring flag values."""
    from specdec.config import load_recipe

    recipe = load_recipe(path, overrides)
    ev = recipe.eval
    values = {
        "target": recipe.target.model, "prompts": ",".join(p.source for p in ev.prompts),
        "num_prompts": ev.num_prompts, "warmup": ev.warmup_prompts, "k": ev.k,
        "temperature": ev.temperature, "top_k": ev.top_k, "top_p": ev.top_p,
        "max_new_tokens": ev.max_new_tokens, "seed": ev.seed, "dtype": recipe.target.dtype,
        "cache_dir": recipe.target.cache_dir,
        "max_ngram": getattr(recipe.drafter, "max_ngram", SCORE_DEFAULTS["max_ngram"]),
        "draft_forward": ev.draft_forward, "draft_confidence": ev.draft_confidence,
        "target_forward": ev.target_forward,
    }  # fmt: skip
    return values, recipe.drafter.type


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
    from specdec.drafters import read_meta
    from specdec.export import EXPORTERS, export
    from specdec.target import FrozenTarget

    if args.format not in EXPORTERS:
        export(args.format, args.checkpoint, "", None)  # one line naming the known formats
    meta = read_meta(args.checkpoint)
    out = args.out or str(Path(args.checkpoint).resolve().parent.parent / "export" / args.format)
    _check_export_out(out, args.force)
    target = FrozenTarget.load(
        args.target or meta.get("target") or "smollm2-135m-instruct", cache_dir=args.cache_dir
    )
    print(f"exported and verified: {export(args.format, args.checkpoint, out, target)}")


def _check_export_out(out: str, force: bool) -> None:
    """An export never replaces what a user owns unless told to."""
    if force:
        return
    path = Path(out)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise SpecdecError(f"--out {out}: exists and is not empty; pass --force to replace it")


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
    s.add_argument(
        "--config",
        help="take target, drafter type and eval settings from a recipe "
        "(flags given explicitly win)",
    )
    s.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    who = s.add_mutually_exclusive_group()
    who.add_argument("--checkpoint", help="a trained drafter checkpoint directory")
    who.add_argument("--drafter", help="a training-free drafter by name (prompt_lookup)")
    who.add_argument("--draft-model", help="any causal LM with the target's vocabulary")
    s.add_argument("--target", help="target model (default: the checkpoint's, else SmolLM2)")
    s.add_argument(
        "--prompts",
        help="comma-separated prompt sources: packaged names or "
        ".jsonl/.json files (default: mtbench,humaneval)",
    )
    s.add_argument("--num-prompts", type=int, help="prompts scored after warm-up (default 8)")
    s.add_argument("--warmup", type=int, help="warm-up prompts, not counted (default 1)")
    s.add_argument("--k", type=int, help="draft tokens per round (default 4)")
    s.add_argument("--temperature", type=float, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, help="default 0: off")
    s.add_argument("--top-p", type=float, help="default 1.0: off")
    s.add_argument("--max-new-tokens", type=int, help="default 128")
    s.add_argument("--max-ngram", type=int, help="prompt lookup's longest n-gram (default 3)")
    s.add_argument("--seed", type=int, help="default 0")
    s.add_argument(
        "--exact-verify-length",
        action="store_true",
        help="verify exactly the drafted tokens instead of padding short drafts to "
        "the cheapest verify length of the measured cost profile",
    )
    s.add_argument(
        "--draft-forward",
        choices=["auto", "transformers", "float32", "float16", "bfloat16"],
        help="how a draft model runs: auto (default) is specdec's compact forward, in float16 "
        "on a CPU, where the architecture has one; transformers is the model's own forward",
    )
    s.add_argument(
        "--draft-confidence",
        type=float,
        help="a draft model stops drafting once its probability of its chain so far falls below "
        "this (default 0: always k tokens); the output stays exact",
    )
    s.add_argument(
        "--target-forward",
        choices=["auto", "compact", "transformers"],
        help="how the target runs, for plain and speculative decoding alike: auto (default) is "
        "specdec's compact forward in the target's dtype on a CPU where the architecture has one",
    )
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32")
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
    e.add_argument(
        "--format", default="hf", help="hf (a draft model), speculators or sglang (EAGLE-3 heads)"
    )
    e.add_argument("--force", action="store_true", help="replace an existing --out directory")
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
