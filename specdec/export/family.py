"""Exports in layouts the drafter families declare themselves (``layouts``: format -> weights
file, and ``layout_keys(format, config)``), written and verified by
:mod:`specdec.export.layout`, so a family brings its serving formats without this package
naming it. One format may hold several families; the checkpoint's family decides how it is
written."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from specdec import drafters
from specdec.export.layout import export_layout


def family_exporters() -> dict[str, Callable[..., Path]]:
    """Format name -> exporter, for every layout the registered families declare."""
    return {fmt: partial(export_layout, fmt) for fmt in drafters.layout_formats()}
