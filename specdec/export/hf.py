"""Export a drafter checkpoint as a plain transformers model directory.

The result loads with ``AutoModelForCausalLM.from_pretrained`` and serves as the assistant in
``generate(assistant_model=...)`` or as the draft model of a serving engine's draft-model
speculative decoding. It carries the target's tokenizer and, in its ``config.json``, a
``specdec_export`` entry naming the drafter family and the target it was trained for.

Only full-vocabulary drafters export to this format: a reduced output vocabulary needs the
``vocab_map`` that only specdec's decoder applies.

Verification, before the directory is moved into place: the reloaded model has the same
parameters (the saved keys plus weights tied to them), the same tokenizer vocabulary, and the
same logits as the checkpoint's model on a few token sequences.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import specdec
from specdec import drafters
from specdec.drafters import read_meta
from specdec.errors import ModelError
from specdec.files import atomic_dir

#: fp32 tolerance of the reloaded model's logits
ATOL, RTOL = 1e-5, 1e-4
PROBE_TEXTS = ("The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n")


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, target) -> Path:
    """Write and verify the transformers export of a checkpoint.

    Args:
        checkpoint_dir: a checkpoint saved by specdec of a drafter that is a standalone
            causal LM (``Drafter.transformers_model``).
        out_dir: the export directory; an existing one is replaced once the new one verifies.
        target: the :class:`~specdec.target.FrozenTarget` the drafter was trained for.

    Returns:
        ``out_dir``.

    Raises:
        ModelError: the drafter is no standalone full-vocabulary causal LM, or verification
            failed.
    """
    meta = read_meta(checkpoint_dir)
    drafter = drafters.load(checkpoint_dir, target)
    model = drafter.transformers_model(str(checkpoint_dir)).eval()
    model.config.specdec_export = {
        "drafter": drafter.name,
        "target": meta.get("target"),
        "specdec_version": specdec.__version__,
    }
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        verify_hf(tmp, model, target.tokenizer)
    return Path(out_dir)


@torch.no_grad()
def verify_hf(path: str | os.PathLike, model, tokenizer) -> None:
    """Check that ``path`` reloads as ``model`` with ``tokenizer``.

    Raises:
        ModelError: a key, the tokenizer or the logits differ.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_keys(path, model, reloaded)
    if type(tokenizer).from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise ModelError(f"{path}: the saved tokenizer differs from the target's")
    device = next(model.parameters()).device
    reloaded.to(device)
    for ids in _probe_sequences(tokenizer):
        ids = ids.to(device).unsqueeze(0)  # [1, T]
        want = model(input_ids=ids).logits.float()  # [1, T, V]
        got = reloaded(input_ids=ids).logits.float()
        if not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
            diff = (got - want).abs().max().item()
            raise ModelError(
                f"{path}: reloaded logits differ from the checkpoint's (max {diff:.2e})"
            )


def _check_keys(path: Path, model, reloaded) -> None:
    """Saved keys are the model's; the keys not saved are weights tied to saved ones."""
    from safetensors import safe_open

    saved: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            saved |= set(handle.keys())
    expected, state = set(model.state_dict()), reloaded.state_dict()
    if unknown := saved - expected:
        raise ModelError(f"{path}: unexpected weights {sorted(unknown)[:5]}")
    if set(state) != expected:
        raise ModelError(f"{path}: reloaded keys differ: {sorted(set(state) ^ expected)[:5]}")
    stored = {state[k].data_ptr() for k in saved}
    if missing := sorted(k for k in expected - saved if state[k].data_ptr() not in stored):
        raise ModelError(f"{path}: weights not saved: {missing[:5]}")


def _probe_sequences(tokenizer) -> list[torch.Tensor]:
    """A few fixed texts and one seeded random sequence, as ``[T]`` token ids."""
    texts = [tokenizer(t, return_tensors="pt").input_ids[0] for t in PROBE_TEXTS]
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, len(tokenizer), (24,), generator=generator)
    return [t for t in texts if len(t)] + [noise]
