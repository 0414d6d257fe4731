"""Load a specdec EAGLE-3 export with vLLM's own ``speculators`` loader and compare its
training-time-test logits with specdec's, step by step. Not part of the test suite:
``speculators`` pins an older transformers, so it lives in a directory of its own.

    pip install --target /tmp/sp --no-deps speculators==0.9.0 hs-connectors==0.9.0 \\
        transformers==5.19.0 loguru pydantic-settings python-dotenv openai jiter distro
    python tests/interop/speculators_parity.py --speculators-path /tmp/sp

Phase one (this environment) builds a tiny target and a perturbed head, exports it in the
speculators layout and writes the reference logits; phase two (``speculators`` and its
transformers first on the path) loads the export with ``Eagle3DraftModel.from_pretrained``
with the verifier's embedding (the export carries none) and prints the largest logit
difference of each unrolled step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

STEPS = 3


def reference(work: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiny_models

    from specdec import drafters
    from specdec.drafters.eagle3 import Eagle3Config
    from specdec.export import export
    from specdec.target import FrozenTarget

    model, tokenizer = tiny_models.tiny_llama()
    tiny_models.save_tiny(model, tokenizer, work / "target")  # the verifier speculators reads
    target = FrozenTarget(model, tokenizer, name=str(work / "target"))
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    head = drafters.build(target, Eagle3Config(draft_vocab_size=80, ttt_steps=STEPS), counts)
    with torch.no_grad():
        for p in head.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export(
        "speculators", head.save(work / "ckpt", target_name=target.name), work / "export", target
    )
    ids = torch.randint(0, target.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    out = target.forward(ids, hidden_layers=head.required_target_layers)
    features = [out.hidden_states[i] for i in head.required_target_layers]
    with torch.no_grad():
        logits = head.module.eval()(ids, None, features)  # [S, 1, T, D]
    torch.save({"ids": ids, "features": torch.cat(features, -1), "logits": logits}, work / "ref.pt")


def compare(work: Path) -> None:
    import transformers
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig

    ref = torch.load(work / "ref.pt")
    config = Eagle3SpeculatorConfig.from_pretrained(work / "export")
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(work / "export", config=config).eval()
    # the export carries no embedding (serving engines share the verifier's); speculators
    # 0.9.0 leaves it unloaded here, so it is given the verifier's, as vLLM does
    embedding = load_file(work / "target" / "model.safetensors")["model.embed_tokens.weight"]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)
    captured = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    ids = ref["ids"]
    T = ids.shape[1]
    shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1)  # row t reads token t + 1
    with torch.no_grad():
        model(
            hidden_states=ref["features"],
            input_ids=shifted,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=STEPS,
        )
    for s in range(STEPS):
        rows = T - 1 - s  # rows whose inputs are real tokens in both
        diff = (ref["logits"][s, 0, :rows] - captured[s][0, :rows]).abs().max().item()
        print(f"speculators (transformers {transformers.__version__}) step {s}: "
              f"max |logit difference| {diff:.2e} over {rows} positions")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--speculators-path", required=True)
    parser.add_argument("--compare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare:
        return compare(Path(args.compare))
    with tempfile.TemporaryDirectory() as work:
        reference(Path(work))
        env = {**os.environ, "PYTHONPATH": args.speculators_path, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, __file__, "--speculators-path", ".", "--compare", work]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
