"""The target's cached forward over m = 1..k+1 new tokens: transformers vs specdec's compact
forward, with each matrix-product layout (``F.linear``, ``W @ x.T``, on a CPU oneDNN's
reordered weights from three rows on, and the kernels measured on this host per row count,
the default), one run. Not a test: a measurement.

Prints milliseconds per forward and each method's ratio to transformers at the same m, and the
verify cost ratio v(m) = t(m) / t(1) that bounds what speculative decoding can gain.

    python bench/compact_forward.py                     # SmolLM2-135M, float32
    python bench/compact_forward.py --dtype float16 --max-tokens 8
"""

from __future__ import annotations

import argparse

import torch

from specdec.decoding import compact, kernels
from specdec.decoding.session import ModelSession
from specdec.scoring.run import cost_profile
from specdec.target import FrozenTarget

LABELS = {"linear": "F.linear", "transposed": "W @ x.T", "packed": "packed", "tuned": "tuned"}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    target = FrozenTarget.load(args.target, dtype=args.dtype)
    model, dtype = target.model, getattr(torch, args.dtype)
    prompt = [(13 * i) % 1000 + 100 for i in range(args.prompt_tokens)]
    sessions = {"transformers": ModelSession(model)}
    runs = set(kernels.kernels_for(target.device, dtype)) | {"transposed"}
    for layout, label in LABELS.items():
        if set((compact.LAYOUTS[layout] or {}).values()) <= runs:
            sessions[f"compact, {label}"] = compact.CompactSession(model, dtype, layout=layout)
    results = {}
    for name, session in sessions.items():
        seconds = cost_profile(session, prompt, args.max_tokens, args.repeats)
        results[name] = {m: 1000 * t for m, t in seconds.items()}
    chosen = compact.target_session(model)
    default = type(chosen).__name__
    layout = LABELS.get(getattr(chosen, "layout", None), "-")
    tuned = getattr(sessions.get("compact, tuned"), "linear", None)
    print(
        f"target {target.name} ({args.dtype}, {target.device}), {args.prompt_tokens} cached "
        f"tokens, threads {torch.get_num_threads()}; target_session uses {default} ({layout})"
    )
    ms = list(range(1, args.max_tokens + 1))
    print(f"{'ms per forward':<22}" + "".join(f"{f'm={m}':>9}" for m in ms))
    for name, t in results.items():
        print(f"{name:<22}" + "".join(f"{t[m]:>9.1f}" for m in ms))
    print(f"{'vs transformers':<22}")
    for name, t in results.items():
        ratios = "".join(f"{t[m] / results['transformers'][m]:>8.2f}x" for m in ms)
        print(f"  {name:<20}" + ratios)
    if tuned is not None:
        print(f"tuned kernels: {tuned.describe()}")
    print(f"{'v(m) = t(m) / t(1)':<22}")
    for name, t in results.items():
        print(f"  {name:<20}" + "".join(f"{t[m] / t[1]:>9.2f}" for m in ms))


if __name__ == "__main__":
    main()
