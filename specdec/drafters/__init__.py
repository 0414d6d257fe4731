"""Drafter families, by registry name.

Each family lives in its own module with the same shape (see :mod:`specdec.drafters.base`).
Families that need training are built from checkpoints; ``prompt_lookup`` needs nothing.
"""

from __future__ import annotations

import difflib

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import ConfigError

REGISTRY: dict[str, type[Drafter]] = {
    "draft_model": DraftModelDrafter,
    "prompt_lookup": PromptLookupDrafter,
}


def drafter_class(name: str) -> type[Drafter]:
    """The drafter family called ``name``; a clear error names the known ones."""
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"unknown drafter '{name}'{hint}; available: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name]


__all__ = [
    "REGISTRY",
    "Drafter",
    "DraftModelDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "drafter_class",
]
