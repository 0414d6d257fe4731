"""Checkpoints: the files a draft model is saved as, and loading them back; and, at the end,
the checkpoint files every head family (EAGLE-3, Medusa, MTP) shares (:func:`write_head`,
:func:`read_head`, :func:`check_head_fits`).

``DraftModelDrafter.save`` writes a transformers directory (``save_pretrained``, safetensors),
the target's tokenizer, ``vocab_map.safetensors`` when the vocabulary is reduced, and
``drafter.json``. A full-vocabulary checkpoint is a plain transformers model (it works as
``assistant_model`` in ``generate``). A reduced-vocabulary one is not: its head has D rows while
``config.vocab_size`` is the input vocabulary, so it loads only through :func:`load_reduced`
(``DraftModelDrafter.from_checkpoint``) and decodes only with specdec's decoder; its config says
so in ``specdec_draft_vocab_size``.

Loaders import :mod:`specdec.drafters.draft_model` when called, since that module imports this
one for the file names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from specdec.errors import ModelError, first_line

if TYPE_CHECKING:
    from specdec.drafters.draft_model import DraftModelDrafter

CHECKPOINT_FILE = "drafter.json"
VOCAB_MAP_FILE = "vocab_map.safetensors"
#: config attribute of a reduced-vocabulary draft model: the number of rows of its LM head
REDUCED_VOCAB_ATTR = "specdec_draft_vocab_size"
#: files a saved tokenizer consists of (one of them is enough to expect a readable one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def read_meta(path: str | os.PathLike) -> dict:
    """The ``drafter.json`` of a checkpoint directory."""
    meta = Path(path) / CHECKPOINT_FILE
    if not meta.is_file():
        raise ModelError(f"not a specdec checkpoint: {path} (no {CHECKPOINT_FILE} found)")
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError as err:
        raise ModelError(f"{meta}: unreadable ({err.msg}, line {err.lineno})") from None


def load_reduced(path: Path, target) -> DraftModelDrafter:
    """A reduced-vocabulary checkpoint: the model is built from its config with a D-row head,
    then its state dict is loaded (plain ``from_pretrained`` expects V rows)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.draft_model_init import reduce_head

    _check_tokenizer(str(path), target.tokenizer)
    try:
        config = AutoConfig.from_pretrained(path)
        vocab_map = load_file(path / VOCAB_MAP_FILE)["vocab_map"]
        state = {}
        for file in sorted(path.glob("model*.safetensors")):
            state.update(load_file(file))
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # garbage or truncated
        raise ModelError(f"{path}: unreadable checkpoint ({first_line(err)})") from None
    size = getattr(config, REDUCED_VOCAB_ATTR, None)
    if size != len(vocab_map) or int(vocab_map.max()) >= target.vocab_size:
        raise ModelError(f"{path}: {VOCAB_MAP_FILE} does not fit its config or the target")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reduce_head(model, torch.arange(size))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ModelError(f"{path}: weights do not fit the config: {err}") from None
    model.to(target.device)
    return DraftModelDrafter(model, target.vocab_size, vocab_map, tokenizer=target.tokenizer)


def _check_tokenizer(path_or_id: str, target_tokenizer) -> None:
    """The draft's saved tokenizer must be the target's (read with the target's tokenizer class:
    ``AutoTokenizer`` may pick a model-specific class that adds tokens of its own)."""
    from transformers import AutoTokenizer

    tokenizer, error = None, None
    for loader in (type(target_tokenizer), AutoTokenizer):
        try:
            tokenizer = loader.from_pretrained(path_or_id)
            break
        except Exception as err:  # no usable tokenizer for this reader: try the next one
            error = err
            continue
    if tokenizer is None:
        saved = [f for f in TOKENIZER_FILES if (Path(path_or_id).expanduser() / f).exists()]
        if saved:  # files that should have been read: a drafter of unknown vocabulary
            where = Path(path_or_id) / saved[0]
            raise ModelError(f"{where}: unreadable tokenizer ({first_line(error)})")
        return  # weights without a tokenizer: the embedding size is checked by the caller
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ModelError(
            f"draft model {path_or_id} has a different vocabulary from the target "
            f"({len(tokenizer)} vs {len(target_tokenizer)} tokens); a draft model must share "
            "the target's tokenizer"
        )


def load_draft_model(
    path_or_id: str, target_tokenizer, target_vocab_size: int, *, dtype=None, device=None
) -> DraftModelDrafter:
    """Load any causal LM that shares the target's tokenizer as a drafter.

    Raises:
        ModelError: the path does not exist, or the draft's vocabulary is not the target's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.drafters.draft_model import DraftModelDrafter

    local = Path(path_or_id).expanduser()
    looks_local = path_or_id.startswith((".", "/", "~")) or local.exists()
    if looks_local and not local.is_dir():
        raise ModelError(f"draft model not found: {path_or_id}")
    _check_tokenizer(path_or_id, target_tokenizer)
    try:
        if getattr(AutoConfig.from_pretrained(path_or_id), REDUCED_VOCAB_ATTR, None):
            raise ModelError(
                f"{path_or_id} has a reduced output vocabulary: load it as a specdec checkpoint "
                "(--checkpoint); it decodes only with specdec's decoder"
            )
        model, info = AutoModelForCausalLM.from_pretrained(
            path_or_id, dtype=dtype or torch.float32, output_loading_info=True
        )
    except (OSError, ValueError, SafetensorError) as err:
        raise ModelError(f"cannot load draft model {path_or_id}: {first_line(err)}") from None
    missing = sorted(info.get("missing_keys") or ()) + sorted(info.get("mismatched_keys") or ())
    if missing:  # from_pretrained would leave them randomly initialised
        raise ModelError(
            f"draft model {path_or_id}: {len(missing)} weights missing or misshapen in its "
            f"files ({', '.join(str(k) for k in missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    if model.get_input_embeddings().num_embeddings < len(target_tokenizer):
        raise ModelError(
            f"draft model {path_or_id} embeds {model.get_input_embeddings().num_embeddings} "
            f"tokens but the target's tokenizer has {len(target_tokenizer)}"
        )
    if device is not None:
        model = model.to(device)
    return DraftModelDrafter(model, target_vocab_size, tokenizer=target_tokenizer)


# ------------------------------------------------ checkpoints of heads (EAGLE-3, Medusa, MTP)

HEAD_CONFIG_FILE = "config.json"
HEAD_WEIGHTS_FILE = "model.safetensors"


def write_head(
    path: str | os.PathLike,
    drafter,
    *,
    target_name: str,
    extra: dict | None,
    meta: dict,
    config: dict,
    files=None,
) -> Path:
    """Write a head family's checkpoint atomically (complete or absent): ``model.safetensors``
    (the module's state, and the ``d2t`` / ``t2d`` maps of a reduced vocabulary),
    ``config.json`` and ``drafter.json`` (family, target, draft vocabulary, ``meta``, then
    ``extra``, which may not overwrite them); ``files(tmp)`` writes anything more."""
    from safetensors.torch import save_file

    import specdec
    from specdec.drafters import vocabulary
    from specdec.files import atomic_dir

    ids = drafter.draft_ids
    meta = {
        "type": drafter.name,
        "target": target_name,
        "draft_vocab_size": None if ids is None else len(ids),
        **meta,
        "specdec_version": specdec.__version__,
    }
    if clash := set(meta) & set(extra or {}):
        raise ValueError(f"extra entries would overwrite {sorted(clash)}")
    meta.update(extra or {})
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.model.state_dict().items()}
    if ids is not None:
        state["d2t"] = vocabulary.d2t(ids.cpu())
        state["t2d"] = vocabulary.t2d(ids.cpu(), drafter.vocab_size)
    with atomic_dir(path) as tmp:
        if files is not None:
            files(tmp)
        save_file(state, tmp / HEAD_WEIGHTS_FILE)
        (tmp / HEAD_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / CHECKPOINT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return Path(path)


def read_head(
    path: str | os.PathLike, family: str, keys: tuple[str, ...]
) -> tuple[dict, dict, object]:
    """``(config.json, state, draft ids or None)`` of a checkpoint :func:`write_head` wrote
    for ``family``, whose config must hold ``keys``.

    Raises:
        ModelError: another family's checkpoint, or unreadable files.
    """
    from safetensors.torch import load_file

    from specdec.drafters import vocabulary

    path = Path(path)
    meta = read_meta(path)
    if meta.get("type") != family:
        raise ModelError(f"{path}: a '{meta.get('type')}' checkpoint, not '{family}'")
    try:
        saved = json.loads((path / HEAD_CONFIG_FILE).read_text())
        missing = [k for k in keys if k not in saved]
        if missing:
            raise KeyError(missing[0])
        state = load_file(path / HEAD_WEIGHTS_FILE)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise ModelError(f"{path}: unreadable {family} checkpoint ({err})") from None
    draft_ids = vocabulary.from_d2t(state.pop("d2t")) if "d2t" in state else None
    state.pop("t2d", None)
    return saved, state, draft_ids


def check_head_fits(path: Path, saved: dict, sizes: dict, draft_ids, target) -> None:
    """A head's ``sizes`` (``hidden_size``, ``draft_vocab_size``, ``own_head``: an LM head of
    its own over ``draft_ids``, else the target's) against ``target``.

    Raises:
        ModelError: made for a target of another width or vocabulary, or a draft vocabulary
            that does not fit its head.
    """
    if sizes["hidden_size"] != target.hidden_size or (
        not sizes["own_head"] and sizes["draft_vocab_size"] != target.vocab_size
    ):
        raise ModelError(
            f"{path}: made for a target with hidden size {sizes['hidden_size']} and "
            f"vocabulary {saved.get('target_vocab_size')}; {target.name} has "
            f"{target.hidden_size} and {target.vocab_size}"
        )
    if sizes["own_head"] and (
        draft_ids is None
        or len(draft_ids) != sizes["draft_vocab_size"]
        or int(draft_ids.max()) >= target.vocab_size
    ):
        raise ModelError(f"{path}: its draft vocabulary (d2t) does not fit its head or target")
