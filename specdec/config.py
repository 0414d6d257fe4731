"""The recipe schema: typed dataclasses with help text, strict YAML loading and dotted overrides.

A recipe is a YAML file whose sections mirror :class:`Recipe`. Every key is checked against the
schema: unknown keys (with a close-match suggestion), wrong types, values outside a ``Literal``
or a field's range raise :class:`~specdec.errors.ConfigError` with one line naming the file
(or the ``--set`` override) and the dotted key. Nothing else in specdec parses recipes.

YAML is read with 1.2 scalars: ``3e-4`` is a float and ``no``/``off`` stay strings, so
``train.mixed_precision: no`` means what it says.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import operator
import os
import re
import tempfile
import types
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from specdec.errors import ConfigError

__all__ = [
    "Recipe", "RunConfig", "TargetConfig", "DrafterConfig", "PromptSource", "RegenerateConfig",
    "DataConfig", "LossConfig", "TrainConfig", "EvalConfig", "ExportConfig", "DRAFTER_TYPES",
    "EXPORT_FORMATS", "LOSS_NAMES", "TRACKERS", "describe", "iter_recipes", "load_recipe",
    "recipe_from_dict", "recipe_to_dict", "save_recipe"
]  # fmt: skip

LossName = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "ce"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
DRAFTER_TYPES = ("draft_model", "medusa", "mtp", "eagle3", "prompt_lookup")
EXPORT_FORMATS = ("hf", "speculators", "sglang", "medusa")
TRACKERS = ("wandb", "tensorboard")
DEFAULT_TARGET = "smollm2-135m-instruct"
ACCELERATE_DIR = "accelerate"


def _opt(default: Any = MISSING, help: str = "", **rules: Any) -> Any:
    """A dataclass field with help text and optional ``rules`` checked on load.

    Rules: ``ge``, ``gt``, ``le`` bound a number; ``choices`` lists the allowed strings (for a
    list, each item; for a dict, each key). Mutable defaults become factories.
    """
    metadata = {"help": help, **rules}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------- schema


@dataclass
class RunConfig:
    name: str = _opt("run", "Run name; the run directory is runs/<name> unless output_dir is set.")
    output_dir: str | None = _opt(None, "Run directory (checkpoints, metrics); null: runs/<name>.")
    seed: int = _opt(0, "Seed for model initialisation, data order and sampling.")
    log_level: Literal["debug", "info", "warning"] = _opt("info", "Logging verbosity.")


@dataclass
class TargetConfig:
    model: str = _opt(
        DEFAULT_TARGET,
        f"Frozen target: '{DEFAULT_TARGET}' (the embedded default), a hub id, a local "
        "directory, or a path to a .gguf file.",
    )
    gguf_file: str | None = _opt(None, "GGUF file name inside a hub repo or local directory.")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of the target.")
    dtype: Literal["float32", "bfloat16", "float16"] = _opt("float32", "Target weight dtype.")
    device: str = _opt("auto", "Device of the target: auto, cpu, cuda, cuda:1, mps ...")
    cache_dir: str | None = _opt(
        None, "Model/data cache; null: $SPECDEC_CACHE or ~/.cache/specdec."
    )
    attn_implementation: str | None = _opt(None, "transformers attention backend, e.g. sdpa.")
    trust_remote_code: bool = _opt(False, "Allow custom modeling code from the hub repo.")


@dataclass
class DrafterConfig:
    type: str = _opt("draft_model", "Drafter family (registry name).", choices=DRAFTER_TYPES)
    from_pretrained: str | None = _opt(None, "Start from a saved drafter checkpoint directory.")
    num_layers: int = _opt(2, "Decoder layers of the drafter.", ge=1)
    hidden_size: int | None = _opt(None, "Drafter hidden size; null: the target's.", ge=1)
    intermediate_size: int | None = _opt(None, "MLP size; null: the target's.", ge=1)
    num_attention_heads: int | None = _opt(None, "Attention heads; null: the target's.", ge=1)
    num_key_value_heads: int | None = _opt(None, "Key/value heads; null: the target's.", ge=1)
    init_from_target: bool = _opt(True, "Copy embeddings, head and layers from the target.")
    init_layers: list[int] = _opt(
        [], "Target layers copied into the drafter (negatives count from the end); []: spread."
    )
    draft_vocab_size: int | None = _opt(
        None, "Reduced output vocabulary (most frequent target tokens); null: the full one.", ge=1
    )
    num_heads: int = _opt(4, "Prediction heads (medusa) or extra positions (mtp).", ge=1)
    max_ngram: int = _opt(3, "Longest n-gram matched in the context (prompt_lookup).", ge=1)
    min_ngram: int = _opt(1, "Shortest n-gram matched in the context (prompt_lookup).", ge=1)


@dataclass
class PromptSource:
    _shorthand = "source"  # a bare string in YAML means {source: <string>}

    source: str = _opt(
        help="A packaged name (alpaca_eval, arena_hard, ifeval, writingbench_en, mtbench, "
        "humaneval), a local .jsonl/.json/.parquet file, or a hub dataset id."
    )
    format: Literal["auto", "sharegpt", "messages", "prompt", "turns"] = _opt(
        "auto", "Row shape; auto detects it from the first row."
    )
    split: str = _opt("train", "Split of a hub dataset.")
    limit: int | None = _opt(None, "Use at most this many rows of this source.", ge=1)
    category: str | None = _opt(None, "Keep only rows of this category.")


@dataclass
class RegenerateConfig:
    enabled: bool = _opt(True, "Replace reference answers with the target's own completions.")
    max_new_tokens: int = _opt(256, "Length of each regenerated answer.", ge=1)
    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.", ge=0)
    top_p: float = _opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    top_k: int = _opt(0, "Top-k sampling; 0 is off.", ge=0)
    batch_size: int = _opt(16, "Prompts generated together.", ge=1)
    seed: int = _opt(0, "Sampling seed.")
    shard_size: int = _opt(64, "Rows per saved shard; an interrupted run resumes per shard.", ge=1)


@dataclass
class DataConfig:
    prompts: list[PromptSource] = _opt(
        [PromptSource(s) for s in ("alpaca_eval", "arena_hard", "ifeval", "writingbench_en")],
        "Training prompt sources, concatenated in order.",
    )
    max_prompts: int | None = _opt(None, "Use at most this many prompts in all.", ge=1)
    max_length: int = _opt(1024, "Longest tokenized conversation.", ge=2)
    overflow: Literal["truncate", "drop"] = _opt("truncate", "What to do with longer ones.")
    require_assistant: bool = _opt(False, "Error on a chat row without an assistant turn.")
    regenerate: RegenerateConfig = _opt(RegenerateConfig(), "Target regeneration of answers.")
    dataset_dir: str | None = _opt(None, "Where regenerated data lives; null: <run dir>/data.")
    num_proc: int = _opt(1, "Processes used for tokenization.", ge=1)


@dataclass
class LossConfig:
    name: LossName = _opt("forward_kl", "Divergence between target and drafter distributions.")
    mix: dict[str, float] = _opt(
        {}, "Weighted mix of losses, e.g. {forward_kl: 0.5, ce: 0.5}; overrides name.",
        choices=LOSS_NAMES, ge=0,
    )  # fmt: skip
    temperature: float = _opt(1.0, "Softmax temperature of both distributions.", gt=0)
    beta: float = _opt(0.5, "JSD interpolation weight.", ge=0, le=1)
    teacher_top_k: int | None = _opt(None, "Keep only the target's top-k logits.", ge=1)


@dataclass
class TrainConfig:
    lr: float = _opt(3e-4, "Peak learning rate (AdamW).", gt=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay.", ge=0)
    warmup_steps: int = _opt(0, "Linear warm-up steps.", ge=0)
    schedule: Literal["cosine", "linear", "constant"] = _opt("cosine", "Decay after warm-up.")
    max_steps: int = _opt(1000, "Optimizer steps; 0 trains nothing (score only).", ge=0)
    batch_size: int = _opt(8, "Sequences per device per micro-batch.", ge=1)
    grad_accum: int = _opt(1, "Micro-batches per optimizer step.", ge=1)
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm; 0 is off.", ge=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = _opt(
        "auto", "Autocast of the drafter; auto: bf16 where the GPU supports it, else no."
    )
    save_every: int = _opt(200, "Checkpoint (and score) every this many steps.", ge=1)
    log_every: int = _opt(10, "Log metrics every this many steps.", ge=1)
    resume: bool = _opt(True, "Resume from the latest checkpoint in the run directory.")
    trackers: list[str] = _opt([], "Extra trackers (jsonl is always on).", choices=TRACKERS)
    wandb_project: str = _opt("specdec", "Weights & Biases project.")


@dataclass
class EvalConfig:
    prompts: list[PromptSource] = _opt(
        [PromptSource("mtbench"), PromptSource("humaneval")], "Held-out prompt sources."
    )
    num_prompts: int = _opt(8, "Held-out prompts scored, in all, across the sources.", ge=1)
    k: int = _opt(4, "Draft tokens proposed per step.", ge=1)
    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.", ge=0)
    top_k: int = _opt(0, "Top-k sampling; 0 is off.", ge=0)
    top_p: float = _opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    max_new_tokens: int = _opt(128, "Tokens generated per prompt.", ge=1)
    seed: int = _opt(0, "Sampling seed.")
    warmup_prompts: int = _opt(1, "Prompts run first and left out of timings.", ge=0)


@dataclass
class ExportConfig:
    formats: list[str] = _opt(["hf"], "Export formats.", choices=EXPORT_FORMATS)
    output_dir: str | None = _opt(None, "Where exports go; null: <run dir>/export.")


@dataclass
class Recipe:
    run: RunConfig = _opt(RunConfig(), "Name, directory, seed and logging of the run.")
    target: TargetConfig = _opt(TargetConfig(), "The frozen target model.")
    drafter: DrafterConfig = _opt(DrafterConfig(), "The drafter being trained or scored.")
    data: DataConfig = _opt(DataConfig(), "Training prompts and their regeneration.")
    loss: LossConfig = _opt(LossConfig(), "Distillation loss.")
    train: TrainConfig = _opt(TrainConfig(), "Optimisation and checkpointing.")
    eval: EvalConfig = _opt(EvalConfig(), "Scoring of checkpoints.")
    export: ExportConfig = _opt(ExportConfig(), "Export of the trained drafter.")

    @property
    def run_dir(self) -> Path:
        """The run directory: ``run.output_dir`` or ``runs/<run.name>``."""
        return Path(self.run.output_dir) if self.run.output_dir else Path("runs") / self.run.name


def _cross_checks(r: Recipe) -> None:
    """Rules that involve more than one field."""
    if not r.run.name.strip():
        raise _Invalid("run.name", "expected a non-empty name")
    d = r.drafter
    if d.max_ngram < d.min_ngram:
        message = f"expected >= drafter.min_ngram ({d.min_ngram}), got {d.max_ngram}"
        raise _Invalid("drafter.max_ngram", message, also=["drafter.min_ngram"])
    if d.type == "draft_model" and d.init_layers and len(d.init_layers) != d.num_layers:
        n = len(d.init_layers)
        message = f"expected drafter.num_layers ({d.num_layers}) entries, got {n}"
        raise _Invalid("drafter.init_layers", message, also=["drafter.num_layers"])
    if r.loss.mix and sum(r.loss.mix.values()) <= 0:
        raise _Invalid("loss.mix", "expected weights with a positive sum")


# ------------------------------------------------------------------------------ YAML 1.2 scalars


class _Loader(yaml.SafeLoader):
    """SafeLoader whose booleans and floats follow YAML 1.2."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":bool", ":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: plain data only
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        parts = (getattr(e, "context", None), getattr(e, "problem", None))
        problem = " ".join(str(p) for p in parts if p) or str(e).replace("\n", " ")
        raise ConfigError(f"{source}: {where}invalid YAML ({problem})") from None


# -------------------------------------------------------------------------------- generic loader


class _Invalid(Exception):
    """A problem at a dotted key; turned into a ConfigError once the source is known.

    ``also`` lists other keys the problem involves (cross-field rules), so an override of any
    of them is named as the source.
    """

    def __init__(self, key: str, message: str, also: Sequence[str] = ()) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message, self.keys = key, message, (key, *also)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(value: str, allowed: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(value, list(allowed), n=1)
    return f" (did you mean '{_join(prefix, close[0])}'?)" if close else ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """Readable name of a schema type, e.g. ``int | None`` or ``'cosine' | 'linear'``."""
    if _is_union(tp):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (list, dict):
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{get_origin(tp).__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


_EXPECTED = {str: "a string", int: "an integer", float: "a float", bool: "a boolean (true/false)"}


def _expected(tp: Any) -> str:
    if _is_union(tp):
        names = [_expected(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in get_args(tp) else "")
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return "a list"
    if get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return _EXPECTED.get(tp, _type_name(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against the schema type ``tp`` and return it as that type."""
    origin = get_origin(tp)
    if _is_union(tp):
        if value is None and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is not type(None):
                try:
                    return _convert(arg, value, key)
                except _Invalid as e:
                    if e.key != key:  # a problem deeper inside: report that one
                        raise
    elif origin is Literal:
        if isinstance(value, str | int) and value in get_args(tp):
            return value
        hint = _suggest(str(value), [str(a) for a in get_args(tp)])
        raise _Invalid(key, f"expected {_expected(tp)}, got {_show(value)}{hint}")
    elif origin is list and isinstance(value, list):
        return [_convert(get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {str(k): _convert(get_args(tp)[1], v, _join(key, str(k))) for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    elif tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif tp in (int, str, bool) and type(value) is tp:  # strict: true is not 1, 1 is not "1"
        return value
    raise _Invalid(key, f"expected {_expected(tp)}, got {_show(value)}")


_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


def _check_rules(f: dataclasses.Field, value: Any, key: str) -> None:
    """The ``choices`` and bounds of a field: per item for a list, per key/value for a dict."""
    if isinstance(value, dict):
        names = [(_join(key, k), k) for k in value]
        numbers = [(_join(key, k), v) for k, v in value.items()]
    else:
        items = value if isinstance(value, list) else [value]
        names = numbers = [
            (f"{key}[{i}]" if items is value else key, v) for i, v in enumerate(items)
        ]
    choices = f.metadata.get("choices")
    for item_key, name in names if choices else ():
        if name not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            hint = _suggest(str(name), choices)
            raise _Invalid(item_key, f"expected one of {allowed}, got {_show(name)}{hint}")
    for item_key, number in numbers:
        if isinstance(number, bool) or not isinstance(number, int | float):
            continue
        for rule, (symbol, holds) in _BOUNDS.items():
            if rule in f.metadata and not holds(number, f.metadata[rule]):  # NaN fails too
                raise _Invalid(item_key, f"expected {symbol} {f.metadata[rule]}, got {number!r}")


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly: unknown keys are errors."""
    shorthand = getattr(cls, "_shorthand", None)
    if shorthand and isinstance(data, str):
        data = {shorthand: data}
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise _Invalid(prefix, f"expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            hint = _suggest(str(name), list(fields), prefix)
            raise _Invalid(_join(prefix, str(name)), f"unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(_hints(cls)[name], data[name], key)
            _check_rules(f, kwargs[name], key)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise _Invalid(key, "required")
    return cls(**kwargs)


def _validate(data: Any) -> Recipe:
    recipe = _build(Recipe, data)
    _cross_checks(recipe)
    return recipe


def _message(source: str, error: _Invalid, key: str | None = None) -> str:
    """``source: key: message``; the key is left out when the source already names it."""
    if not error.key or error.key == key:
        return f"{source}: {error.message}"
    return f"{source}: {error.key}: {error.message}"


# ------------------------------------------------------------------------------------- overrides


def _merge(base: Any, value: Any) -> Any:
    if isinstance(base, dict) and isinstance(value, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in value.items()}}
    return value


def _apply_override(data: dict, item: str) -> str:
    """Set one ``dotted.key=value`` in the raw recipe mapping; returns the dotted key.

    A mapping value merges into a section (``data.regenerate={enabled: false}`` keeps the
    file's other keys); any other value replaces what was there. Types are checked later, with
    the whole recipe, and errors under this key name the override.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. train.lr=3e-4")
    value = _parse_yaml(text, f"--set {item}") if text.strip() else ""
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = _merge(node.get(parts[-1]), value)
    return key


def _related(a: str, b: str) -> bool:
    """Whether dotted key ``a`` is ``b``, above it or below it."""
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith((short + ".", short + "["))


# ------------------------------------------------------------------------------------ public API


def recipe_from_dict(data: dict, source: str = "<dict>") -> Recipe:
    """Build and validate a :class:`Recipe` from a plain mapping.

    Raises:
        ConfigError: naming ``source`` and the dotted key of the first problem.
    """
    try:
        return _validate(data)
    except _Invalid as e:
        raise ConfigError(_message(source, e)) from None


def load_recipe(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe YAML (the defaults when ``path`` is None) and apply ``--set`` overrides.

    Args:
        path: the recipe file; None starts from the defaults.
        overrides: ``"dotted.key=value"`` strings, applied in order; values are YAML, so
            ``eval.prompts=[mtbench]`` and ``loss.mix={jsd: 1.0}`` work.

    Raises:
        ConfigError: one line naming the file or the override, and the dotted key.
    """
    source, data = "<defaults>", {}
    if path is not None:
        source = str(path)
        if not Path(path).is_file():
            raise ConfigError(f"recipe not found: {source}")
        data = _parse_yaml(Path(path).read_text(encoding="utf-8"), source)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of sections, got {_show(data)}")
        if "distributed_type" in data or "compute_environment" in data:
            raise ConfigError(
                f"{source}: an accelerate config, not a recipe; "
                "pass it to `accelerate launch --config_file`"
            )
    keys = [_apply_override(data, item) for item in overrides]
    try:
        return _validate(data)
    except _Invalid as e:
        for key, item in reversed(list(zip(keys, overrides, strict=True))):
            if any(_related(k, key) for k in e.keys):
                raise ConfigError(_message(f"--set {item}", e, key)) from None
        raise ConfigError(_message(source, e)) from None


def recipe_to_dict(recipe: Any) -> dict:
    """Plain dicts, lists and scalars; ``recipe_from_dict`` of the result gives it back."""
    return dataclasses.asdict(recipe)


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> None:
    """Write the resolved recipe as YAML, atomically (a temporary file, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("# Resolved recipe: every key, defaults included.\n" + body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def iter_recipes(root: str | os.PathLike = "recipes") -> list[Path]:
    """Every recipe YAML under ``root``, sorted; the accelerate topologies are skipped."""
    root = Path(root)
    paths = [*root.rglob("*.yaml"), *root.rglob("*.yml")]
    return sorted(p for p in paths if ACCELERATE_DIR not in p.relative_to(root).parts[:-1])


def describe(cls: type = Recipe) -> str:
    """Every key of the schema with its type, default, allowed range and help."""
    return "\n".join(_describe_lines(cls, ""))


def _describe_lines(cls: type, prefix: str) -> Iterator[str]:
    for f in dataclasses.fields(cls):
        key, tp, meta = _join(prefix, f.name), _hints(cls)[f.name], f.metadata
        if dataclasses.is_dataclass(tp):
            yield f"{key}:  # {meta['help']}"
            yield from _describe_lines(tp, key)
            continue
        rules = [f"{_BOUNDS[r][0]} {meta[r]}" for r in _BOUNDS if r in meta]
        if "choices" in meta:
            rules.insert(0, "one of " + ", ".join(meta["choices"]))
        yield f"{key}: {_type_name(tp)} = {_default_text(f)}"
        yield f"    {meta['help']}" + (f" [{'; '.join(rules)}]" if rules else "")
        item = get_args(tp)[0] if get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):
            if getattr(item, "_shorthand", None):
                yield f"    Each item is a mapping or a string meaning {{{item._shorthand}: ...}}."
            yield from _describe_lines(item, f"{key}[]")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        return _show(f.default)
    if f.default_factory is MISSING:
        return "(required)"
    value = f.default_factory()
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "[" + ", ".join(_brief(v) for v in value) + "]"
    return _show(value)


def _brief(item: Any) -> str:
    """A dataclass value as its non-default fields, or as its shorthand string."""
    changed = {
        f.name: getattr(item, f.name)
        for f in dataclasses.fields(item)
        if f.default is MISSING or getattr(item, f.name) != f.default
    }
    shorthand = getattr(item, "_shorthand", None)
    return str(changed[shorthand]) if list(changed) == [shorthand] else _show(changed)
