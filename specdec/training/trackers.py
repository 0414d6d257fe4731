"""Metrics sinks: ``metrics.jsonl`` always (on the main process), plus accelerate's trackers
(wandb, tensorboard) when the recipe selects them. Other processes get a no-op log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specdec.config import Recipe, recipe_to_dict
from specdec.errors import ConfigError
from specdec.files import write_text

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends ``{"step": N, key: value, ...}`` lines; on resume, drops lines after the
    restored step so a killed-and-resumed run has each step once."""

    def __init__(self, path: Path, accelerator, recipe: Recipe, truncate_after: int = 0):
        self.accelerator = accelerator
        self.active = accelerator.is_main_process
        self.file = None
        if not self.active:
            return
        if path.exists():
            kept = [line for line in _lines(path) if line["step"] <= truncate_after]
            write_text(path, "".join(json.dumps(line) + "\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 - kept open for the run
        if accelerator.trackers is not None and recipe.train.trackers:
            accelerator.init_trackers(
                recipe.train.wandb_project,
                config=_flat(recipe),
                init_kwargs={"wandb": {"dir": str(path.parent), "name": recipe.run.name}},
            )

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.accelerator.log(numeric, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _flat(recipe: Recipe) -> dict:
    out = {}
    for section, values in recipe_to_dict(recipe).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = (
                value if isinstance(value, int | float | str | bool) else str(value)
            )
    return out


def _lines(path: Path) -> list[dict]:
    """The logged lines; a last line cut short (a killed write) is dropped with a warning.

    Raises:
        ConfigError: another line is not a JSON object with a step.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            line["step"] + 0  # noqa: B018 - a number, or the error below
        except (ValueError, TypeError, KeyError):
            if i == len(lines):
                logger.warning("%s: dropped its last line, cut short: %.60s", path, text)
                continue
            raise ConfigError(
                f"{path}: line {i} is not a metrics line ({text[:60]!r}); repair or remove it"
            ) from None
        out.append(line)
    return out
