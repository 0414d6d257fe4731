"""Exporters of trained drafters, by format name.

``hf`` lives in its own module; the serving engines' layouts are declared by the drafter
families and written by :mod:`specdec.export.layout`. Each export writes one directory and
verifies it (reload, logits, key set) before moving it into place. Exporters never import
accelerate.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path

from specdec.errors import ConfigError
from specdec.export.family import family_exporters
from specdec.export.hf import export_hf

#: format name -> exporter(checkpoint_dir, out_dir, target) -> out_dir
EXPORTERS: dict[str, Callable[..., Path]] = {
    "hf": export_hf,
    **family_exporters(),
}


def export(fmt: str, checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target) -> Path:
    """Export a checkpoint in format ``fmt`` to ``out_dir``; returns ``out_dir``.

    Raises:
        ConfigError: ``fmt`` is unknown.
        ModelError: the checkpoint cannot be exported in that format or did not verify.
    """
    if fmt not in EXPORTERS:
        close = difflib.get_close_matches(fmt, EXPORTERS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown export format '{fmt}'{hint}; available: {', '.join(sorted(EXPORTERS))}"
        )
    return EXPORTERS[fmt](checkpoint_dir, out_dir, target)


__all__ = [
    "EXPORTERS",
    "export",
    "export_hf",
]
