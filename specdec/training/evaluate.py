"""Score a checkpoint during training with the integrated decoder, on held-out prompts."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from specdec.config import Recipe
from specdec.files import write_json
from specdec.scoring import report
from specdec.scoring.command import load_prompts
from specdec.scoring.run import ScoreSettings, score
from specdec.training.checkpoint import update_best

logger = logging.getLogger(__name__)


def score_checkpoint(model, drafter, target, recipe: Recipe, step: int) -> dict:
    """Save the drafter as ``checkpoints/step-N``, score it, write score.json beside it,
    move ``best``; return the ``eval/*`` metrics for the trackers."""
    run_dir = recipe.run_dir
    ev = recipe.eval
    model.eval()  # the drafter's decoding face runs this very module
    path = drafter.save(
        run_dir / "checkpoints" / f"step-{step:06d}", target_name=target.name, extra={"step": step}
    )
    t0 = time.perf_counter()
    settings = ScoreSettings.from_eval(ev)
    count = ev.num_prompts + ev.warmup_prompts
    rows = load_prompts(tuple(ev.prompts), count, recipe.target.cache_dir)
    result = score(target.model, target.tokenizer, drafter, rows, settings)
    result["target"] = target.name
    result["checkpoint"] = str(path)
    result["score_seconds"] = time.perf_counter() - t0
    write_json(Path(path) / "score.json", result)
    report.plot(result, Path(path) / "score.png")
    best = update_best(run_dir, Path(path), result)
    logger.info(
        "step %d: tau %.3f, speedup %.2fx, greedy match %s, scored in %.0f s%s",
        step,
        result["tau"],
        result["speedup"],
        result["greedy_match_rate"],
        result["score_seconds"],
        " (new best)" if best else "",
    )
    metrics = {
        "eval/tau": result["tau"],
        "eval/speedup": result["speedup"],
        "eval/greedy_match_rate": result["greedy_match_rate"],
        "eval/score_seconds": result["score_seconds"],
    }
    for i, rate in enumerate(result["accept_rate_per_position"], start=1):
        if rate is not None:  # a position never drafted has no rate
            metrics[f"eval/accept@{i}"] = rate
    return metrics


def checkpoint_table(run_dir: Path) -> list[dict]:
    """tau, speedup and greedy identity of every scored checkpoint of a run, in step order."""
    rows = []
    for path in sorted((run_dir / "checkpoints").glob("step-*/score.json")):
        s = json.loads(path.read_text())
        rows.append(
            {
                "checkpoint": path.parent.name,
                "tau": s["tau"],
                "speedup": s["speedup"],
                "greedy_match_rate": s["greedy_match_rate"],
                "accept": s["accept_rate_per_position"],
            }
        )
    return rows
