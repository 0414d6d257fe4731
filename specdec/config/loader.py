"""Reading and writing recipes: YAML 1.2 parsing, ``--set`` overrides, saving and describing.

Every entry point validates through :mod:`specdec.config.validation` and reports the first
problem as a one-line :class:`~specdec.errors.ConfigError` naming the file (or the ``--set``
override) and the dotted key.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import MISSING
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from specdec.config.schema import ACCELERATE_DIR, Recipe
from specdec.config.validation import (
    BOUNDS,
    Invalid,
    hints,
    join_key,
    show,
    type_name,
    validate,
)
from specdec.errors import ConfigError
from specdec.files import write_text

# ------------------------------------------------------------------------------ YAML 1.2 scalars


class _Loader(yaml.SafeLoader):
    """SafeLoader whose booleans and floats follow YAML 1.2, and which refuses a key given
    twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


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


def _message(source: str, error: Invalid, key: str | None = None) -> str:
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
        return validate(data)
    except Invalid as e:
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
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{source}: not UTF-8 text (byte {err.start})") from None
        data = _parse_yaml(text, source)
        if data is None:  # an empty file would silently mean the default recipe
            raise ConfigError(f"{source}: empty; a recipe names at least its target or drafter")
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of sections, got {show(data)}")
        if "distributed_type" in data or "compute_environment" in data:
            raise ConfigError(
                f"{source}: an accelerate config, not a recipe; "
                "pass it to `accelerate launch --config_file`"
            )
    keys = [_apply_override(data, item) for item in overrides]
    try:
        return validate(data)
    except Invalid as e:
        for key, item in reversed(list(zip(keys, overrides, strict=True))):
            if any(_related(k, key) for k in e.keys):
                raise ConfigError(_message(f"--set {item}", e, key)) from None
        raise ConfigError(_message(source, e)) from None


def recipe_to_dict(recipe: Any) -> dict:
    """Plain dicts, lists and scalars; ``recipe_from_dict`` of the result gives it back."""
    return dataclasses.asdict(recipe)


def recipe_text(recipe: Recipe) -> str:
    """The resolved recipe as YAML, every key, defaults included: what :func:`save_recipe`
    writes."""
    body = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)
    return "# Resolved recipe: every key, defaults included.\n" + body


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> None:
    """Write the resolved recipe as YAML, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, recipe_text(recipe))


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
        key, tp, meta = join_key(prefix, f.name), hints(cls)[f.name], f.metadata
        if dataclasses.is_dataclass(tp) and hasattr(tp, "variants"):
            variants = tp.variants()
            yield f"{key}:  # {meta['help']}"
            yield f"{key}.type: one of {', '.join(variants)} = {tp.default_variant()!r}"
            for name, variant in variants.items():
                yield f"{key}:  # when {key}.type is {name!r}"
                yield from (
                    line
                    for line in _describe_lines(variant, key)
                    if not line.startswith(f"{key}.type:")
                )
            continue
        if dataclasses.is_dataclass(tp):
            yield f"{key}:  # {meta['help']}"
            yield from _describe_lines(tp, key)
            continue
        rules = [f"{BOUNDS[r][0]} {meta[r]}" for r in BOUNDS if r in meta]
        if "choices" in meta:
            choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
            rules.insert(0, "one of " + ", ".join(choices))
        yield f"{key}: {type_name(tp)} = {_default_text(f)}"
        yield f"    {meta['help']}" + (f" [{'; '.join(rules)}]" if rules else "")
        item = get_args(tp)[0] if get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):
            if getattr(item, "_shorthand", None):
                yield f"    Each item is a mapping or a string meaning {{{item._shorthand}: ...}}."
            yield from _describe_lines(item, f"{key}[]")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        return show(f.default)
    if f.default_factory is MISSING:
        return "(required)"
    value = f.default_factory()
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "[" + ", ".join(_brief(v) for v in value) + "]"
    return show(value)


def _brief(item: Any) -> str:
    """A dataclass value as its non-default fields, or as its shorthand string."""
    changed = {
        f.name: getattr(item, f.name)
        for f in dataclasses.fields(item)
        if f.default is MISSING or getattr(item, f.name) != f.default
    }
    shorthand = getattr(item, "_shorthand", None)
    return str(changed[shorthand]) if list(changed) == [shorthand] else show(changed)
