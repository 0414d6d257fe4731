"""Exporters of trained drafters, by format name.

Each format lives in its own module, writes one directory and verifies it (reload, logits, key
set) before moving it into place. Exporters never import accelerate.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path

from specdec.errors import ConfigError
from specdec.export.hf import export_hf
from specdec.export.sglang import export_sglang
from specdec.export.speculators import export_speculators

#: format name -> exporter(checkpoint_dir, out_dir, target) -> out_dir
EXPORTERS: dict[str, Callable[..., Path]] = {
    "hf": export_hf,
    "speculators": export_speculators,
    "sglang": export_sglang,
}
#: formats the recipe schema names that have no exporter yet
NOT_YET_AVAILABLE = ("medusa",)


def export(fmt: str, checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target) -> Path:
    """Export a checkpoint in format ``fmt`` to ``out_dir``; returns ``out_dir``.

    Raises:
        ConfigError: ``fmt`` is unknown or not yet available.
        ModelError: the checkpoint cannot be exported in that format or did not verify.
    """
    if fmt not in EXPORTERS:
        available = ", ".join(sorted(EXPORTERS))
        if fmt in NOT_YET_AVAILABLE:
            raise ConfigError(f"export format '{fmt}' is not yet available; available: {available}")
        close = difflib.get_close_matches(fmt, [*EXPORTERS, *NOT_YET_AVAILABLE], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown export format '{fmt}'{hint}; available: {available}; "
            f"not yet available: {', '.join(NOT_YET_AVAILABLE)}"
        )
    return EXPORTERS[fmt](checkpoint_dir, out_dir, target)


__all__ = [
    "EXPORTERS",
    "NOT_YET_AVAILABLE",
    "export",
    "export_hf",
    "export_sglang",
    "export_speculators",
]
