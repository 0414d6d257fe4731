"""Exports of drafters that serving engines load as their own architectures (EAGLE-style heads):
the drafter gives its ``config.json`` and weights in the engine's layout, this module writes
them and verifies the result before it is moved into place:

- the weights are exactly the format's expected key set (engines skip unknown keys silently,
  so a misnamed weight would otherwise be lost without a word);
- the files reload (through the family's ``from_layout``) into a drafter whose logits equal the
  checkpoint's on probe sequences, with the target's features computed for them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec import drafters
from specdec.errors import ModelError
from specdec.files import atomic_dir

CONFIG_FILE = "config.json"
ATOL, RTOL = 1e-5, 1e-4


def export_layout(
    fmt: str, checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target
) -> Path:
    """Write and verify the ``fmt`` export of a checkpoint; returns ``out_dir``. The
    checkpoint's family gives the config, the weights, the weights file and the key set.

    Raises:
        ModelError: the family has no such layout, or verification failed.
    """
    from safetensors.torch import load_file, save_file

    drafter = drafters.load(checkpoint_dir, target)
    family = type(drafter)
    if fmt not in family.layouts:
        raise ModelError(f"a '{drafter.name}' drafter has no '{fmt}' layout")
    config, state = drafter.export_layout(fmt, target)
    weights_file = family.layouts[fmt]
    want = family.layout_keys(fmt, config)
    if set(state) != want:
        raise ModelError(
            f"{fmt} export of {checkpoint_dir}: weights {sorted(set(state) ^ want)[:6]} are not "
            "the format's key set"
        )
    with atomic_dir(out_dir) as tmp:
        save_file(state, tmp / weights_file)
        config |= drafter.export_extras(fmt, target, tmp, Path(out_dir).resolve())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        saved = json.loads((tmp / CONFIG_FILE).read_text())
        reloaded = type(drafter).from_layout(fmt, saved, load_file(tmp / weights_file), target)
        _check_logits(tmp, drafter, reloaded, target)
    return Path(out_dir)


@torch.no_grad()
def _check_logits(path: Path, drafter, reloaded, target) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=generator).to(target.device)
    layers = drafter.required_target_layers
    out = target.forward(ids, hidden_layers=layers)
    features = [out.hidden_states[i] for i in layers]
    want = drafter.layout_module.eval()(ids, None, features)
    got = reloaded.layout_module.eval()(ids, None, features)
    steps = min(len(got), len(want))  # unrolled steps are a training setting, not the format's
    if reloaded.required_target_layers != layers or not torch.allclose(
        got[:steps], want[:steps], atol=ATOL, rtol=RTOL
    ):
        raise ModelError(f"{path}: the reloaded export's logits differ from the checkpoint's")
    if not torch.equal(_ids(reloaded, target), _ids(drafter, target)):
        raise ModelError(f"{path}: the reloaded export's draft vocabulary differs")


def _ids(drafter, target) -> torch.Tensor:
    ids = drafter.draft_ids
    return torch.arange(target.vocab_size) if ids is None else ids.cpu()
