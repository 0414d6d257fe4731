"""Every drafter family trained for the same wall-clock budget on the same data, then measured
side by side on the same held-out prompts: one table.

Each family's demo recipe (``recipes/smollm2-135m/*demo.yaml``) is trained with
``train.max_minutes`` on one regeneration shared by all (``data.dataset_dir``), so the budget
buys each family the steps its own cost allows. Then one ``specdec eval`` decodes the held-out
MT-bench + HumanEval prompts (never trained on) with every family that the shared target
verifies, as a chain and, where the family branches, as a dynamic tree, interleaved per prompt
in one process; Medusa-2 verifies with its own adapted backbone, so it is scored by
``specdec score`` on the same prompts against that backbone's plain decoding. Not a test: a
measurement. Reruns resume: a finished training run trains no more.

    python bench/families.py --minutes 6 --prompts 160 --out runs/families
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "smollm2-135m"
#: family -> (demo recipe, whether the shared target verifies it, whether it branches)
FAMILIES = {
    "draft_model": ("demo.yaml", True, True),
    "eagle3": ("eagle3_demo.yaml", True, True),
    "medusa1": ("medusa1_demo.yaml", True, True),
    "mtp": ("mtp_demo.yaml", True, False),
    "medusa2": ("medusa2_demo.yaml", False, True),
}


def specdec(*args: str) -> None:
    cmd = [sys.executable, "-m", "specdec.cli", *map(str, args)]
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="training budget per family")
    parser.add_argument("--prompts", type=int, default=160, help="training prompts regenerated")
    parser.add_argument("--eval-prompts", type=int, default=10, help="held-out prompts measured")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default="runs/families")
    args = parser.parse_args()
    out = Path(args.out).absolute()
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown[0]!r}; known: {', '.join(FAMILIES)}")

    for name in names:
        specdec(
            "train", "--config", RECIPES / FAMILIES[name][0],
            f"run.output_dir={out / name}", f"data.dataset_dir={out / 'data'}",
            f"data.max_prompts={args.prompts}", "data.regenerate.max_new_tokens=128",
            f"train.max_minutes={args.minutes}", "train.max_steps=100000",
            "train.schedule=constant", "train.save_every=100000", "train.length_group=4",
            "eval.num_prompts=2",
        )  # fmt: skip

    # the held-out prompts, written once so that eval and score decode the same ones in order
    from specdec.scoring.command import load_prompts

    rows = load_prompts(("mtbench", "humaneval"), args.eval_prompts + 1, stratify=True)
    prompts = out / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    common = ("--prompts", prompts, "--num-prompts", args.eval_prompts,
              "--max-new-tokens", args.max_new_tokens, "--k", args.k)  # fmt: skip
    methods = []
    for name in names:
        recipe, shared, branches = FAMILIES[name]
        if shared:
            methods += [str(out / name / "best")] + ([f"{out / name / 'best'}@dynamic"] * branches)
    if methods:
        ev = [a for m in methods for a in ("--method", m)]
        specdec("eval", *common, *ev, "--temperature", "0", "--out", out / "eval", "--force")
    if "medusa2" in names:
        specdec("score", "--checkpoint", out / "medusa2" / "best", *common,
                "--out", out / "medusa2.json", "--force")  # fmt: skip
    table(out, names)


def table(out: Path, names: list[str]) -> None:
    """The markdown table of every family: steps and seconds trained, then the measurements."""
    rows = []
    results = (
        json.loads((out / "eval" / "results.json").read_text()) if (out / "eval").exists() else None
    )
    for name in names:
        summary = _last_training(out / name)
        measured = []
        if results is not None:
            (config,) = results["configs"]
            measured = [
                (m, r) for m, r in config["methods"].items() if m.startswith(str(out / name))
            ]
        if (out / f"{name}.json").exists() and name == "medusa2":
            measured = [("chain, own backbone", json.loads((out / f"{name}.json").read_text()))]
        for method, r in measured:
            shape = "tree" if method.endswith("@dynamic") else "chain"
            accept = " ".join(
                "-" if a is None else f"{a:.2f}" for a in r["accept_rate_per_position"]
            )
            rows.append(
                f"| {name} | {shape} | {summary} | {r['tau']:.3f} | {accept} | {r['c']:.3f} | "
                f"{r['v']:.3f} | {r['speedup']:.3f}x | {r['bound_speedup']:.3f}x | "
                f"{r['efficiency']:.2f} | {r['greedy_match_rate']} |"
            )
    print("| family | draft | steps (s trained) | tau | accept@i | c | v | speedup | bound | "
          "efficiency | identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _last_training(run_dir: Path) -> str:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in lines if "train/seconds" in m][-1]
    return f"{last['step']} ({last['train/seconds']:.0f} s)"


if __name__ == "__main__":
    main()
