"""The ``specdec`` command's flags: one parser, each subcommand naming its handler in
:mod:`specdec.cli` (``handler``). ``specdec score``'s decoding flags are derived from the
recipe schema (:class:`~specdec.config.EvalConfig`), so a flag and its recipe key cannot
disagree."""

from __future__ import annotations

import argparse

#: what ``specdec --help`` says first
DESCRIPTION = (
    "Train speculative-decoding drafters against a frozen target from YAML recipes, score "
    "every checkpoint with an exact speculative decoder, and export them for serving engines."
)

#: the recipe's eval.* keys that ``specdec score`` takes as flags: the schema is the one
#: description of the decoding knobs (type, range, help); a flag is ``--`` + the key
EVAL_FLAGS = (
    "num_prompts", "warmup_prompts", "k", "temperature", "top_k", "top_p", "max_new_tokens",
    "seed", "draft_forward", "draft_confidence", "target_forward", "tree", "tree_top_k",
    "tree_budget", "tree_max_nodes", "tree_choices",
)  # fmt: skip
#: recipe keys of the other flags that describe what to score against
TARGET_FLAGS = {"target": "target.model", "dtype": "target.dtype", "cache_dir": "target.cache_dir"}


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _json(text: str):
    import json

    return json.loads(text)


_json.__name__ = "JSON"


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :data:`EVAL_FLAGS` key, typed and described by the recipe schema."""
    import dataclasses
    from typing import Literal, get_args, get_origin

    from specdec.config import EvalConfig
    from specdec.config.validation import hints

    fields = {f.name: f for f in dataclasses.fields(EvalConfig)}
    for key in EVAL_FLAGS:
        tp, f = hints(EvalConfig)[key], fields[key]
        names = [flag(key)] + (["--warmup"] if key == "warmup_prompts" else [])
        if get_origin(tp) is Literal:
            extra = {"choices": get_args(tp)}
        else:
            extra = {"type": _json if get_origin(tp) is list else tp}
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        parser.add_argument(
            *names,
            dest=key,
            help=f"{f.metadata['help']} (eval.{key}; default {default})",
            **extra,
        )


def build_parser() -> argparse.ArgumentParser:
    from typing import get_args

    from specdec.config import EvalConfig
    from specdec.config.validation import hints

    parser = argparse.ArgumentParser(prog="specdec", description=DESCRIPTION)
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
    add_eval_flags(s)
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
    s.set_defaults(handler="score")

    v = sub.add_parser(
        "eval", help="compare methods side by side over a prompt suite (report, plots)"
    )
    v.add_argument(
        "--method",
        action="append",
        required=True,
        help="repeatable: plain, generate, prompt_lookup, a checkpoint dir, draft_model:PATH, "
        "prompt_lookup+PATH, hf_assisted:PATH, hf_prompt_lookup (plain and generate always run); "
        "a drafter with @dynamic or @static verifies trees, with @confidence=C stops at its "
        "own C; prompt lookup (alone or in a hybrid) with @min_ngram=N trusts matches of N "
        "tokens or more (a hybrid's default: 3), with @copy_start=N copies N tokens at first "
        "and twice as many after each copy accepted whole, up to k (default 4; 0: always k)",
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
            flag(key), default="auto", choices=get_args(tp), help=f"{about} (eval.{key})"
        )
    v.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="drafters stop a chain once its probability falls below this (0: all k); a "
        "method's @confidence=C replaces it for that method",
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
    v.set_defaults(handler="eval")

    f = sub.add_parser("fetch", help="download, verify and cache the target and prompt sets")
    f.add_argument("--target", default="smollm2-135m-instruct")
    f.add_argument(
        "--prompts",
        default="alpaca_eval,arena_hard,ifeval,writingbench_en,healthbench,mtbench,humaneval",
    )
    f.add_argument("--cache-dir")
    f.set_defaults(handler="fetch")

    d = sub.add_parser("data", help="build training data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    r = dsub.add_parser("regenerate", help="the target regenerates the responses of a recipe")
    r.add_argument("--config", required=True, help="recipe YAML")
    r.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides")
    r.set_defaults(handler="regenerate")
    a = dsub.add_parser("cache", help="cache the target's teacher (logits, hidden states)")
    a.add_argument("--config", required=True, help="recipe YAML (its data.cache section)")
    a.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides")
    a.add_argument(
        "--from", dest="source", metavar="DIR",
        help="derive it from the complete cache DIR (a full-vocabulary or wider one) without "
        "the target's forward: fewer top-k, fp8, fewer layers",
    )  # fmt: skip
    a.set_defaults(handler="cache")

    t = sub.add_parser("train", help="distil a drafter from a recipe (under accelerate launch)")
    t.add_argument("--config", required=True, help="recipe YAML")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    t.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    t.set_defaults(handler="train")

    e = sub.add_parser("export", help="export a checkpoint for a serving engine or transformers")
    e.add_argument("--checkpoint", required=True, help="a drafter checkpoint directory")
    e.add_argument(
        "--format",
        default="hf",
        help="hf (a draft model), or a serving layout a drafter family declares "
        "(an unknown name lists them)",
    )
    e.add_argument("--force", action="store_true", help="replace an existing --out directory")
    e.add_argument("--out", help="export directory (default: <run dir>/export/<format>)")
    e.add_argument("--target", help="target model (default: the checkpoint's)")
    e.add_argument("--cache-dir")
    e.set_defaults(handler="export")

    c = sub.add_parser("check", help="validate recipes")
    c.add_argument("recipes", nargs="+")
    c.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    c.set_defaults(handler="check")
    return parser
