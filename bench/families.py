"""Every drafter family trained for the same wall-clock budget on the same data, then measured
side by side on the same held-out prompts: one table.

Each demo recipe (``recipes/smollm2-135m/*demo.yaml``, one per family) is trained with
``train.max_minutes`` on one regeneration shared by all (``data.dataset_dir``), so the budget
buys each family the steps its own cost allows. Then one ``specdec eval`` decodes the held-out
MT-bench + HumanEval prompts (never trained on) with every family that the shared target
verifies, as a chain and, where the family branches, as a dynamic tree, interleaved per prompt
in one process; a drafter verified by an adapted target of its own (Medusa-2) is scored by
``specdec score`` on the same prompts against that model's plain decoding. Whether a drafter
branches or adapts the target is asked of the trained checkpoint, through the registry. Not a
test: a measurement. Reruns resume: a finished training run trains no more.

    python bench/families.py --minutes 6 --prompts 160 --out runs/families

The reference recipes, whose data sections differ, on one recipe's data (all its prompts):

    python bench/families.py --minutes 18 --prompts 0 --data-from recipes/smollm2-135m/eagle3.yaml \
        --recipes recipes/smollm2-135m/{draft_model,eagle3,medusa1,medusa2,mtp}.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "smollm2-135m"


def specdec(*args) -> None:
    cmd = [sys.executable, "-m", "specdec.cli", *map(str, args)]
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--minutes", type=float, default=6.0, help="training budget per family")
    parser.add_argument(
        "--prompts", type=int, default=160, help="training prompts regenerated (0: all of them)"
    )
    parser.add_argument(
        "--data-from", help="train every recipe on this recipe's data section (default: its own)"
    )
    parser.add_argument("--eval-prompts", type=int, default=10, help="held-out prompts measured")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--recipes", nargs="*", help="recipes (default: every *demo.yaml)")
    parser.add_argument("--out", default="runs/families")
    args = parser.parse_args()
    out = Path(args.out).absolute()
    recipes = (
        [Path(r) for r in args.recipes] if args.recipes else sorted(RECIPES.glob("*demo.yaml"))
    )
    missing = [r for r in recipes if not r.is_file()]
    if missing:
        parser.error(f"--recipes: {missing[0]} does not exist")
    data = []
    if args.data_from:  # the recipe read (and checked) as `specdec train` reads it
        from specdec.config import load_recipe
        from specdec.config.loader import recipe_to_dict
        from specdec.errors import ConfigError

        try:
            section = recipe_to_dict(load_recipe(args.data_from))["data"]
        except ConfigError as err:
            parser.error(f"--data-from: {err}")
        data.append(f"data={json.dumps(section)}")
    if args.prompts < 0:
        parser.error(f"--prompts: expected 0 (all) or a positive count, got {args.prompts}")
    if args.prompts:
        data.append(f"data.max_prompts={args.prompts}")

    for recipe in recipes:
        specdec(
            "train", "--config", recipe, *data,
            f"run.output_dir={out / recipe.stem}", f"data.dataset_dir={out / 'data'}",
            "data.regenerate.max_new_tokens=128",
            f"train.max_minutes={args.minutes}", "train.max_steps=100000",
            "train.schedule=constant", "train.save_every=100000", "train.length_group=4",
            "eval.num_prompts=2",
        )  # fmt: skip

    # the held-out prompts, written once so that eval and score decode the same ones in order
    from specdec import drafters
    from specdec.scoring.command import load_prompts
    from specdec.target import FrozenTarget

    rows = load_prompts(("mtbench", "humaneval"), args.eval_prompts + 1, stratify=True)
    prompts = out / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    common = ("--prompts", prompts, "--num-prompts", args.eval_prompts,
              "--max-new-tokens", args.max_new_tokens, "--k", args.k)  # fmt: skip
    target = FrozenTarget.load(drafters.read_meta(out / recipes[0].stem / "best")["target"])
    shared, own = [], []
    for recipe in recipes:
        best = out / recipe.stem / "best"
        drafter = drafters.load(best, target)
        if drafter.adapts_target:
            own.append(recipe.stem)
        else:
            shared += [str(best)] + ([f"{best}@dynamic"] if drafter.branches else [])
    if shared:
        free = list(drafters.training_free())  # the bar a trained drafter must pass
        methods = [a for m in [*shared, *free] for a in ("--method", m)]
        specdec("eval", *common, *methods, "--temperature", "0", "--out", out / "eval", "--force")
    for name in own:
        specdec("score", "--checkpoint", out / name / "best", *common,
                "--out", out / f"{name}.json", "--force")  # fmt: skip
    table(out, [r.stem for r in recipes], own)


def table(out: Path, names: list[str], own: list[str]) -> None:
    """The markdown table of every run: steps and seconds trained, then the measurements."""
    path = out / "eval" / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"configs": [{"methods": {}}]}
    (config,) = results["configs"]
    rows = []
    for name in names:
        if name in own:
            r = json.loads((out / f"{name}.json").read_text())
            kl, agree = r["verifier"]["kl_to_target"], r["verifier"]["top1_agreement"]
            shape = f"chain, own verifier (KL {kl:.2f} nats, top-1 agreement {agree:.2f})"
            rows.append(_row(name, out / name, shape, r))
            continue
        prefix = str(out / name / "best")
        for method, r in config["methods"].items():
            if method.startswith(prefix):
                rows.append(_row(name, out / name, _shape(method), r))
    from specdec import drafters

    for name in drafters.training_free():  # measured beside the trained ones, nothing trained
        if name in config["methods"]:
            rows.append(_row(name, None, "chain", config["methods"][name]))
    print("| recipe | draft | steps (s trained) | tau | accept@i | c | v | speedup | bound | "
          "efficiency | identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _shape(method: str) -> str:
    return "dynamic tree" if method.endswith("@dynamic") else "chain"


def _row(name: str, run_dir: Path | None, shape: str, r: dict) -> str:
    from specdec.scoring.report import rates

    trained = _trained(run_dir) if run_dir else "-"
    return (
        f"| {name} | {shape} | {trained} | {r['tau']:.3f} | {rates(r['accept_rate_per_position'])} "
        f"| {r['c']:.3f} | {r['v']:.3f} | {r['speedup']:.3f}x | {r['bound_speedup']:.3f}x "
        f"| {r['efficiency']:.2f} | {r['greedy_match_rate']} |"
    )


def _trained(run_dir: Path) -> str:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in lines if "train/seconds" in m][-1]
    return f"{last['step']} ({last['train/seconds']:.0f} s)"


if __name__ == "__main__":
    main()
