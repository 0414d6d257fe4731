"""Strict conversion of a raw recipe mapping into the :mod:`~specdec.config.schema` dataclasses.

Unknown keys (with a close-match suggestion), wrong types, values outside a ``Literal`` or a
field's ``choices`` and bounds, and cross-field rules raise :class:`Invalid` at a dotted key;
:mod:`specdec.config.loader` turns that into a one-line ``ConfigError`` naming the source.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import types
from collections.abc import Sequence
from dataclasses import MISSING
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from specdec.config.schema import Recipe


class Invalid(Exception):
    """A problem at a dotted key; turned into a ConfigError once the source is known.

    ``also`` lists other keys the problem involves (cross-field rules), so an override of any
    of them is named as the source.
    """

    def __init__(self, key: str, message: str, also: Sequence[str] = ()) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message, self.keys = key, message, (key, *also)


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(value: str, allowed: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(value, list(allowed), n=1)
    return f" (did you mean '{join_key(prefix, close[0])}'?)" if close else ""


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def type_name(tp: Any) -> str:
    """Readable name of a schema type, e.g. ``int | None`` or ``'cosine' | 'linear'``."""
    if _is_union(tp):
        return " | ".join("None" if a is type(None) else type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (list, dict):
        args = ", ".join(type_name(a) for a in get_args(tp))
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
    return _EXPECTED.get(tp, type_name(tp))


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
                except Invalid as e:
                    if e.key != key:  # a problem deeper inside: report that one
                        raise
    elif origin is Literal:
        if isinstance(value, str | int) and value in get_args(tp):
            return value
        hint = _suggest(str(value), [str(a) for a in get_args(tp)])
        raise Invalid(key, f"expected {_expected(tp)}, got {show(value)}{hint}")
    elif origin is list and isinstance(value, list):
        return [_convert(get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {
            str(k): _convert(get_args(tp)[1], v, join_key(key, str(k))) for k, v in value.items()
        }
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    elif tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif tp in (int, str, bool) and type(value) is tp:  # strict: true is not 1, 1 is not "1"
        return value
    raise Invalid(key, f"expected {_expected(tp)}, got {show(value)}")


BOUNDS = {
    "ge": (">=", operator.ge),
    "gt": (">", operator.gt),
    "le": ("<=", operator.le),
    "lt": ("<", operator.lt),
}


def _check_rules(f: dataclasses.Field, value: Any, key: str) -> None:
    """The ``choices`` and bounds of a field: per item for a list, per key/value for a dict."""
    if isinstance(value, dict):
        names = [(join_key(key, k), k) for k in value]
        numbers = [(join_key(key, k), v) for k, v in value.items()]
    else:
        items = value if isinstance(value, list) else [value]
        names = numbers = [
            (f"{key}[{i}]" if items is value else key, v) for i, v in enumerate(items)
        ]
    choices = f.metadata.get("choices")
    choices = choices() if callable(choices) else choices
    for item_key, name in names if choices else ():
        if name not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            hint = _suggest(str(name), choices)
            raise Invalid(item_key, f"expected one of {allowed}, got {show(name)}{hint}")
    for item_key, number in numbers:
        if isinstance(number, bool) or not isinstance(number, int | float):
            continue
        for rule, (symbol, holds) in BOUNDS.items():
            if rule in f.metadata and not holds(number, f.metadata[rule]):  # NaN fails too
                raise Invalid(item_key, f"expected {symbol} {f.metadata[rule]}, got {number!r}")


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, strictly: unknown keys are errors."""
    shorthand = getattr(cls, "_shorthand", None)
    if shorthand and isinstance(data, str):
        data = {shorthand: data}
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise Invalid(prefix, f"expected a mapping, got {show(data)}")
    if hasattr(cls, "variants"):  # a section whose ``type`` picks its dataclass
        cls = _variant(cls, data, prefix)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            hint = _suggest(str(name), list(fields), prefix)
            raise Invalid(join_key(prefix, str(name)), f"unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = join_key(prefix, name)
        if name in data:
            kwargs[name] = _convert(hints(cls)[name], data[name], key)
            _check_rules(f, kwargs[name], key)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise Invalid(key, "required")
    return cls(**kwargs)


def _variant(cls: type, data: dict, prefix: str) -> type:
    variants = cls.variants()
    name = data.get("type", cls.default_variant())
    if name not in variants:
        allowed = ", ".join(repr(v) for v in variants)
        hint = _suggest(str(name), list(variants))
        raise Invalid(
            join_key(prefix, "type"), f"expected one of {allowed}, got {show(name)}{hint}"
        )
    return variants[name]


def _cross_checks(r: Recipe) -> None:
    """Rules that involve more than one field."""
    if not r.run.name.strip():
        raise Invalid("run.name", "expected a non-empty name")
    if "/" in r.run.name or "\\" in r.run.name or r.run.name.strip() in (".", ".."):
        message = f"{r.run.name!r}: expected a plain name (the run directory is runs/<name>); "
        raise Invalid("run.name", message + "use run.output_dir for a path")
    r.drafter.check()
    _check_tree(r.eval)
    if r.loss.mix and sum(r.loss.mix.values()) <= 0:
        raise Invalid("loss.mix", "expected weights with a positive sum")
    _check_regenerate(r.data.regenerate)
    _check_on_policy(r.data.on_policy, r.train)


def _check_regenerate(gen) -> None:
    from specdec.data import vllm_backend

    if gen.backend == "vllm" and not vllm_backend.available():
        message = f"'vllm' is not installed here; {vllm_backend.INSTALL_HINT}"
        raise Invalid("data.regenerate.backend", message)
    if gen.backend == "vllm" and gen.workers > 1:
        message = "vLLM batches by itself: expected 1 with data.regenerate.backend 'vllm'"
        raise Invalid("data.regenerate.workers", message, also=["data.regenerate.backend"])


def _check_on_policy(policy, train) -> None:
    if policy.fraction == 0:
        return
    if policy.refresh_every >= train.max_steps:
        message = f"{policy.refresh_every} is not below train.max_steps ({train.max_steps}): "
        message += "the drafter's continuations would never be trained on"
        raise Invalid("data.on_policy.refresh_every", message, also=["train.max_steps"])
    if policy.prompts < train.batch_size:
        message = f"{policy.prompts} continuations cannot fill a micro-batch of "
        message += f"train.batch_size {train.batch_size}"
        raise Invalid("data.on_policy.prompts", message, also=["train.batch_size"])


def _check_tree(ev) -> None:
    from specdec.drafters.tree import check_choices

    if ev.tree_choices:
        try:
            check_choices(ev.tree_choices)
        except ValueError as err:
            message = str(err).removeprefix("tree choices: ")
            raise Invalid("eval.tree_choices", message) from None
    elif ev.tree == "static" and ev.warmup_prompts < 1:
        message = "a static tree without choices is calibrated on the warm-up prompts: expected "
        message += "eval.warmup_prompts >= 1, or the choices"
        raise Invalid("eval.tree_choices", message, also=["eval.tree", "eval.warmup_prompts"])


def validate(data: Any) -> Recipe:
    recipe = _build(Recipe, data)
    _cross_checks(recipe)
    return recipe
