"""The recipe schema: typed dataclasses with help text, strict YAML loading and dotted overrides.

A recipe is a YAML file whose sections mirror :class:`Recipe`. Every key is checked against the
schema: unknown keys (with a close-match suggestion), wrong types, values outside a ``Literal``
or a field's range raise :class:`~specdec.errors.ConfigError` with one line naming the file
(or the ``--set`` override) and the dotted key. Nothing else in specdec parses recipes.

YAML is read with 1.2 scalars: ``3e-4`` is a float and ``no``/``off`` stay strings, so
``train.mixed_precision: no`` means what it says.

Modules: :mod:`~specdec.config.schema` (the dataclasses), :mod:`~specdec.config.validation`
(type and rule checks) and :mod:`~specdec.config.loader` (YAML, overrides, save, describe).
"""

from specdec.config.loader import (
    describe,
    iter_recipes,
    load_recipe,
    recipe_from_dict,
    recipe_text,
    recipe_to_dict,
    save_recipe,
)
from specdec.config.schema import (
    ACCELERATE_DIR,
    DEFAULT_TARGET,
    LOSS_NAMES,
    TRACKERS,
    DataConfig,
    DrafterConfig,
    EvalConfig,
    ExportConfig,
    LossConfig,
    LossName,
    PromptSource,
    Recipe,
    RegenerateConfig,
    RunConfig,
    TargetConfig,
    TrainConfig,
    export_formats,
)

__all__ = [
    "Recipe", "RunConfig", "TargetConfig", "DrafterConfig", "PromptSource", "RegenerateConfig",
    "DataConfig", "LossConfig", "TrainConfig", "EvalConfig", "ExportConfig",
    "export_formats", "LOSS_NAMES", "TRACKERS", "describe", "iter_recipes", "load_recipe",
    "recipe_from_dict", "recipe_text", "recipe_to_dict", "save_recipe", "ACCELERATE_DIR",
    "DEFAULT_TARGET", "LossName",
]  # fmt: skip
