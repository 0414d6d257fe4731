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

#: the recipe's eval.* keys that ``specdec score`` takes as flags: the schema is the one
#: description of the decoding knobs (type, range, help); a flag is ``--`` + the key
EVAL_FLAGS = (
    "num_prompts", "warmup_prompts", "k", "temperature", "top_k", "top_p", "max_new_tokens",
    "seed", "draft_forward", "draft_confidence", "target_forward", "tree", "tree_top_k",
    "tree_budget", "tree_max_nodes", "tree_choices",
)  # fmt: skip
#: recipe keys of the other flags that describe what to score against
TARGET_FLAGS = {"target": "target.model", "dtype": "target.dtype", "cache_dir": "target.cache_dir"}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _score(args: argparse.Namespace) -> None:
    from specdec.scoring.command import ScoreJob, run_scoring
    from specdec.scoring.report import table
    from specdec.scoring.run import ScoreSettings

    recipe = _score_recipe(args)
    drafter = args.drafter
    if args.config and not (args.checkpoint or args.drafter or args.draft_model):
        drafter = recipe.drafter.type
    ev = recipe.eval
    job = ScoreJob(
        checkpoint=args.checkpoint,
        drafter=drafter,
        draft_model=args.draft_model,
        # without --target or --config, a checkpoint is scored against its own target
        target=recipe.target.model if (args.target or args.config) else None,
        prompts=tuple(p.source for p in ev.prompts),
        num_prompts=ev.num_prompts,
        out=args.out,
        cache_dir=recipe.target.cache_dir,
        dtype=recipe.target.dtype,
        max_ngram=args.max_ngram or getattr(recipe.drafter, "max_ngram", None),
        force=args.force,
        certify=args.certify,
    )
    settings = ScoreSettings.from_eval(ev, shape_verify=not args.exact_verify_length)
    result = run_scoring(job, settings)
    print(table(result))
    print(f"wrote {result['json']} and {result['plot']}")


def _score_recipe(args: argparse.Namespace):
    """The recipe (``--config`` or the defaults) with the flags given applied as overrides, so
    every value is checked by the schema; an error names the flag."""
    import json

    from specdec.config import load_recipe
    from specdec.errors import ConfigError

    flags: dict[str, str] = {}  # override -> the flag as typed
    for key in EVAL_FLAGS:
        value = getattr(args, key)
        if value is not None:
            flags[f"eval.{key}={json.dumps(value)}"] = f"{_flag(key)} {value}"
    for key, where in TARGET_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            flags[f"{where}={json.dumps(value)}"] = f"{_flag(key)} {value}"
    if args.prompts is not None:
        sources = [p for p in args.prompts.split(",") if p]
        flags[f"eval.prompts={json.dumps(sources)}"] = f"--prompts {args.prompts}"
    if args.max_ngram is not None and args.max_ngram < 1:
        raise ConfigError(f"--max-ngram {args.max_ngram}: expected >= 1")
    try:
        return load_recipe(args.config, [*args.set, *flags])
    except ConfigError as err:
        message = str(err)
        for override, flag in flags.items():
            if message.startswith(f"--set {override}:"):
                message = flag + message[len(f"--set {override}") :]
        raise ConfigError(message) from None


def _eval(args: argparse.Namespace) -> None:
    from specdec.scoring.suite import EvalJob, read_results, run_eval, write_results
    from specdec.scoring.suite_report import compare, write_report

    job = EvalJob(
        methods=args.method,
        out=args.out,
        prompts=[p for p in (args.prompts or "").split(",") if p],
        suite=args.suite,
        category_column=args.category_column,
        num_prompts=args.num_prompts,
        warmup=args.warmup,
        ks=_numbers(args.k, int, "--k"),
        temperatures=_numbers(args.temperature, float, "--temperature"),
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        target=args.target,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        max_ngram=args.max_ngram,
        target_forward=args.target_forward,
        draft_forward=args.draft_forward,
        draft_confidence=args.draft_confidence,
        tree_top_k=args.tree_top_k,
        tree_budget=args.tree_budget,
        tree_max_nodes=args.tree_max_nodes,
        bootstrap=args.bootstrap,
        certify=args.certify,
        force=args.force,
    )
    job.check()  # flags and method specs, before the earlier results or any model are read
    old = read_results(args.compare) if args.compare else None
    results = run_eval(job)
    out = Path(args.out)
    write_results(results, out)
    paths = write_report(results, out, old)
    print((out / "report.md").read_text())
    if old is not None:
        print("\n".join(compare(old, results)))
    print(f"wrote {out / 'results.json'}, " + ", ".join(str(p) for p in paths))


def _numbers(text: str, kind: type, flag: str) -> list:
    from specdec.errors import ConfigError

    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text}: expected comma-separated {kind.__name__}s") from None


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


def _cache(args: argparse.Namespace) -> None:
    from specdec.data.build import cache_from_recipe, describe_cache

    print(describe_cache(cache_from_recipe(args.config, args.set)))


def _train(args: argparse.Namespace) -> None:
    from specdec.config import load_recipe
    from specdec.scoring.report import rates
    from specdec.training.loop import train

    summary = train(load_recipe(args.config, args.overrides + args.set))
    for row in summary["scores"]:
        accept = rates(row["accept"])
        print(
            f"{row['checkpoint']}  tau {row['tau']:.3f}  speedup {row['speedup']:.2f}x  "
            f"greedy identity {row['greedy_match_rate']}  accept@i {accept}"
        )
    print(f"run directory: {summary['run_dir']} ({summary['steps']} steps)")
    if summary.get("best"):
        best = summary["best"]
        print(
            f"best checkpoint: {Path(summary['run_dir']) / best['path']} (tau {best['tau']:.3f}, "
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


def _json(text: str):
    import json

    return json.loads(text)


_json.__name__ = "JSON"


def _add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :data:`EVAL_FLAGS` key, typed and described by the recipe schema."""
    import dataclasses
    from typing import Literal, get_args, get_origin

    from specdec.config import EvalConfig
    from specdec.config.validation import hints

    fields = {f.name: f for f in dataclasses.fields(EvalConfig)}
    for key in EVAL_FLAGS:
        tp, f = hints(EvalConfig)[key], fields[key]
        names = [_flag(key)] + (["--warmup"] if key == "warmup_prompts" else [])
        if get_origin(tp) is Literal:
            extra = {"choices": get_args(tp)}
        else:
            extra = {"type": _json if get_origin(tp) is list else tp}
        parser.add_argument(
            *names,
            dest=key,
            help=f"{f.metadata['help']} (eval.{key}; default {f.default})",
            **extra,
        )


def build_parser() -> argparse.ArgumentParser:
    from typing import get_args

    from specdec.config import EvalConfig
    from specdec.config.validation import hints

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
    s.add_argument("--max-ngram", type=int, help="prompt lookup's longest n-gram (default 3)")
    s.add_argument(
        "--exact-verify-length",
        action="store_true",
        help="verify exactly the drafted tokens instead of padding short drafts to "
        "the cheapest verify length of the measured cost profile",
    )
    _add_eval_flags(s)
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32")
    s.add_argument("--cache-dir", help="specdec cache (default $SPECDEC_CACHE or ~/.cache)")
    s.add_argument("--out", help="score.json path (default: beside the checkpoint, or ./)")
    s.add_argument("--force", action="store_true", help="replace an existing score file")
    s.add_argument(
        "--certify",
        type=int,
        default=0,
        help="draws (16 tokens each) of the T=1 losslessness test recorded in score.json "
        "(0: greedy only)",
    )
    s.set_defaults(func=_score)

    v = sub.add_parser(
        "eval", help="compare methods side by side over a prompt suite (report, plots)"
    )
    v.add_argument(
        "--method",
        action="append",
        required=True,
        help="repeatable: plain, generate, prompt_lookup, a checkpoint dir, draft_model:PATH, "
        "prompt_lookup+PATH, hf_assisted:PATH, hf_prompt_lookup (plain and generate always run); "
        "a drafter with @dynamic or @static verifies trees",
    )
    v.add_argument("--out", required=True, help="directory for results.json, report.md, plots")
    v.add_argument("--prompts", help="comma-separated prompt files, packaged names or hub ids")
    v.add_argument("--suite", help="a built-in suite: spec (mtbench,humaneval), mtbench, "
                   "humaneval, chat")  # fmt: skip
    v.add_argument("--category-column", help="the column of a prompt file that names categories")
    v.add_argument("--num-prompts", type=int, default=16, help="prompts measured (default 16)")
    v.add_argument("--warmup", type=int, default=1, help="prompts decoded first and dropped")
    v.add_argument("--k", default="4", help="draft tokens per round, comma-separated sweep")
    v.add_argument("--temperature", default="0", help="comma-separated sweep (0: greedy)")
    v.add_argument("--top-k", type=int, default=0)
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--max-new-tokens", type=int, default=128)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--target", help="target model (default: the checkpoints', else SmolLM2)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    v.add_argument("--cache-dir")
    v.add_argument("--max-ngram", type=int, help="prompt lookup's longest n-gram")
    for key in ("target_forward", "draft_forward"):  # the choices the recipe schema allows
        tp = hints(EvalConfig)[key]
        about = EvalConfig.__dataclass_fields__[key].metadata["help"]
        v.add_argument(
            _flag(key), default="auto", choices=get_args(tp), help=f"{about} (eval.{key})"
        )
    v.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="drafters stop a chain once its probability falls below this (0: all k)",
    )
    v.add_argument("--tree-top-k", type=int, default=4, help="@dynamic/@static: children "
                   "per expanded node and nodes expanded per depth")  # fmt: skip
    v.add_argument("--tree-budget", type=int, default=0, help="@dynamic: nodes verified per "
                   "round (0: chosen from the measured verify cost)")  # fmt: skip
    v.add_argument("--tree-max-nodes", type=int, default=24, help="the largest tree verified")
    v.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    v.add_argument(
        "--certify",
        type=int,
        default=0,
        help="draws (16 tokens each) of the T=1 losslessness test per drafter method "
        "(0: greedy only)",
    )
    v.add_argument("--compare", metavar="OLD.json", help="an earlier results.json to diff against")
    v.add_argument("--force", action="store_true", help="replace results in --out")
    v.set_defaults(func=_eval)

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
    a = dsub.add_parser("cache", help="cache the target's teacher (logits, hidden states)")
    a.add_argument("--config", required=True, help="recipe YAML (its data.cache section)")
    a.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides")
    a.set_defaults(func=_cache)

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
