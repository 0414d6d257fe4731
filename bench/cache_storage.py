"""What each teacher-cache storage choice costs on disk and what it loses, on a recipe's data.

The first ``--rows`` training rows of the recipe are cached with every storage choice (one
target pass each, same rows); each is read back and compared with the float32 full-vocabulary
cache, which reads back the target's own forward (``tests/test_cache.py``). Printed per choice:
MB per 1,000 tokens, KL(full || read back) and the total variation distance per teacher
position (mean and 99th percentile; TV bounds how much any acceptance rate sum min(p, q) can
move), how often its top token is the target's, and the hidden states' RMS error relative to their
RMS. Not a test: a measurement.

    python bench/cache_storage.py --config recipes/smollm2-135m/eagle3.yaml --rows 32
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec import drafters
from specdec.config import load_recipe
from specdec.data.build import load_training_data
from specdec.data.cache import build_cache, fingerprint
from specdec.data.cache_read import TeacherCache
from specdec.target import FrozenTarget

CHOICES = [
    (0, "float32"),
    (0, "float16"),
    (0, "bfloat16"),
    (0, "fp8"),
    (256, "float16"),
    (256, "bfloat16"),
    (256, "fp8"),
    (64, "float16"),
    (64, "fp8"),
    (16, "float16"),
    (16, "fp8"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--config", default="recipes/smollm2-135m/eagle3.yaml")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = load_recipe(args.config, args.overrides)
    target = FrozenTarget.from_config(recipe.target)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    layers = drafters.for_recipe(recipe.drafter, target, dataset).required_target_layers
    # a sample over the recipe's sources (its rows come source after source)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(recipe.run.seed))
    dataset = dataset.select(sorted(order[: args.rows].tolist()))
    caches = {}
    with tempfile.TemporaryDirectory() as tmp:
        for top_k, dtype in CHOICES:
            cfg = SimpleNamespace(top_k=top_k, dtype=dtype, shard_rows=16, batch_size=8)
            fp = fingerprint(target, recipe.target, dataset, layers, cfg)
            out = Path(tmp) / f"{top_k}-{dtype}"
            manifest = build_cache(target, dataset, fp, out, cfg.batch_size, progress=False)
            caches[(top_k, dtype)] = (TeacherCache(out, fp), manifest)
        exact = caches[(0, "float32")][0]
        reference = [exact.row(i) for i in range(len(dataset))]
        tokens = caches[(0, "float32")][1]["tokens"]
        print(
            f"{args.config}: {len(dataset)} rows, {tokens} tokens, "
            f"{caches[(0, 'float32')][1]['teacher_positions']} teacher positions, layers "
            f"{list(layers)}, vocabulary {target.vocab_size}"
        )
        print(
            "top-k   dtype     MB/1k tokens  KL mean   KL p99    TV mean   TV p99  top-1 same"
            "  hidden rel. RMS err"
        )
        for (top_k, dtype), (cache, manifest) in caches.items():
            kl, tv, same, err, norm = [], [], [], 0.0, 0.0
            for i, ref in enumerate(reference):
                row = cache.row(i)
                p = ref["log_p"]
                kl.append((p.exp() * (p - row["log_p"])).sum(-1))
                tv.append((p.exp() - row["log_p"].exp()).abs().sum(-1) / 2)
                same.append(row["log_p"].argmax(-1) == p.argmax(-1))
                if "features" in ref:
                    err += float((row["features"] - ref["features"]).pow(2).sum())
                    norm += float(ref["features"].pow(2).sum())
            kl, tv, same = torch.cat(kl), torch.cat(tv), torch.cat(same).float()
            rel = (err / norm) ** 0.5 if norm else float("nan")
            print(
                f"{top_k or 'full':<8}{dtype:<10}{manifest['bytes'] / tokens / 1000:>12.3f}"
                f"{kl.mean():>10.2e}{kl.quantile(0.99):>10.2e}{tv.mean():>10.2e}"
                f"{tv.quantile(0.99):>10.2e}{same.mean():>12.4f}{rel:>14.2e}"
            )


if __name__ == "__main__":
    main()
