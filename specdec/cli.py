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

from specdec.cli_parser import EVAL_FLAGS, TARGET_FLAGS, build_parser, flag
from specdec.errors import SpecdecError


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
        prompts=tuple(ev.prompts),
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
            flags[f"eval.{key}={json.dumps(value)}"] = f"{flag(key)} {value}"
    for key, where in TARGET_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            flags[f"{where}={json.dumps(value)}"] = f"{flag(key)} {value}"
    if args.prompts is not None:
        sources = [p for p in args.prompts.split(",") if p]
        flags[f"eval.prompts={json.dumps(sources)}"] = f"--prompts {args.prompts}"
    if args.max_ngram is not None and args.max_ngram < 1:
        raise ConfigError(f"--max-ngram {args.max_ngram}: expected >= 1")
    try:
        return load_recipe(args.config, [*args.set, *flags])
    except ConfigError as err:
        message = str(err)
        for override, typed in flags.items():
            if message.startswith(f"--set {override}:"):
                message = typed + message[len(f"--set {override}") :]
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

    print(describe_cache(cache_from_recipe(args.config, args.set, args.source)))


def _train(args: argparse.Namespace) -> None:
    from specdec.config import load_recipe
    from specdec.scoring.report import rates
    from specdec.training.loop import train

    summary = train(load_recipe(args.config, args.overrides + args.set))
    if not summary["main_process"]:
        return  # one report per run, not one per process
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


#: subcommand -> what runs it (the parser names them, :mod:`specdec.cli_parser`)
HANDLERS = {
    "score": _score, "eval": _eval, "fetch": _fetch, "regenerate": _regenerate,
    "cache": _cache, "train": _train, "export": _export, "check": _check,
}  # fmt: skip


#: what a rerun of an interrupted subcommand picks up (the others start again)
RESUMES = {
    "train": "the same command resumes from the latest saved state",
    "regenerate": "the same command keeps the saved shards and generates the rest",
    "cache": "the same command keeps the saved shards and builds the rest",
}


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
        HANDLERS[args.handler](args)
    except SpecdecError as err:
        print(f"specdec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resumes = RESUMES.get(args.handler)
        print("specdec: interrupted" + (f"; {resumes}" if resumes else ""), file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
