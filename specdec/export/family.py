"""Exports in layouts a drafter family declares itself (``layouts``: format -> weights file,
and ``layout_keys(format, config)``), written and verified by :mod:`specdec.export.layout`, so
a family brings its serving formats without this package naming it."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from specdec import drafters
from specdec.export.layout import export_layout


def export_family_layout(
    fmt: str, checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target
) -> Path:
    cls = drafters.layout_formats()[fmt]
    keys = partial(cls.layout_keys, fmt)
    return export_layout(fmt, checkpoint_dir, out_dir, target, keys, weights_file=cls.layouts[fmt])


def family_exporters() -> dict[str, Callable[..., Path]]:
    """Format name -> exporter, for every layout the registered families declare."""
    return {fmt: partial(export_family_layout, fmt) for fmt in drafters.layout_formats()}
