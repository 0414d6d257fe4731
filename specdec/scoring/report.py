"""A readable table and a plot (acceptance by position, accepted lengths) of a score."""

from __future__ import annotations

from pathlib import Path


def table(result: dict) -> str:
    """A plain-text summary of a score."""
    s = result["settings"]
    rows = [
        ("drafter", result["drafter"]),
        ("prompts", f"{result['num_prompts']} (+{result['warmup_prompts']} warm-up)"),
        ("k / temperature", f"{s['k']} / {s['temperature']}"),
        ("mean draft length", f"{result.get('mean_drafted', 0):.2f}"),
        ("tree", _tree(result)),
        ("tau (tokens per target forward)", f"{result['tau']:.3f}"),
        ("alpha (per-token acceptance)", f"{result['alpha']:.3f}"),
        ("accept@i", rates(result["accept_rate_per_position"])),
        ("accept@i | accepted <i", rates(result["conditional_accept_rate_per_position"])),
        ("accepted-length histogram", " ".join(map(str, result["accepted_length_histogram"]))),
        ("c (draft step / target step)", f"{result['c']:.3f}"),
        ("v (verify / target step)", f"{result['v']:.3f}"),
        (
            "tokens/s method / baseline",
            f"{result['tokens_per_second']:.2f} / {result['baseline_tokens_per_second']:.2f}",
        ),
        ("speedup", f"{result['speedup']:.3f}x"),
        (
            "analytic bound / efficiency",
            f"{result['bound_speedup']:.3f}x / {result['efficiency']:.2f}",
        ),
        ("overhead outside forwards", f"{100 * result['overhead_fraction']:.1f}%"),
        ("KV compaction (share of rounds)", f"{100 * result.get('keep_fraction', 0):.2f}%"),
        (
            "forwards: target / draft",
            f"{s.get('target_forward', 'auto')} / {result.get('draft_forward') or '-'}"
            + (f", confidence {c}" if (c := result.get("draft_confidence")) else ""),
        ),
    ]
    if result.get("greedy_match_rate") is not None:
        rows.append(("greedy identity", f"{100 * result['greedy_match_rate']:.1f}% of prompts"))
        for d in result.get("divergences", []):
            rows.append(
                (
                    "  diverged",
                    f"prompt {d['prompt']} at token {d['position']}, "
                    f"top-2 margin {d.get('top2_margin', float('nan')):.2e}",
                )
            )
    for kind, cert in (result.get("certificate") or {}).items():
        if kind == "greedy":
            rows.append(
                ("certificate, greedy", f"{cert['identical']}/{cert['prompts']} identical, "
                 f"{len(cert['near_ties'])} near-ties, {len(cert['failures'])} failures")
            )  # fmt: skip
        elif kind == "sampling":
            rows.append(
                ("certificate, T=1 test", f"{cert['samples']} draws of {cert['tokens']} tokens, "
                 f"p = {cert['p_value']:.3g} ({'passed' if cert['passed'] else 'FAILED'})")
            )  # fmt: skip
    profile = result.get("cost_profile_ratio", {})
    rows.append(("verify cost, m tokens / 1", " ".join(f"{m}:{r:.2f}" for m, r in profile.items())))
    for cat, r in result.get("per_category", {}).items():
        rows.append(
            (f"  {cat}", f"tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x, n={r['num_prompts']}")
        )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def plot(result: dict, path: str | Path) -> Path:
    """Acceptance by draft position and the accepted-length histogram, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    positions = range(1, len(result["accept_rate_per_position"]) + 1)
    left.plot(
        positions, curve(result["accept_rate_per_position"]), "o-", label="P(accepted length >= i)"
    )
    left.plot(
        positions,
        curve(result["conditional_accept_rate_per_position"]),
        "s--",
        label="P(i accepted | < i accepted)",
    )
    left.set(
        xlabel="draft position i",
        ylabel="rate",
        ylim=(0, 1.05),
        title=f"acceptance (tau = {result['tau']:.2f})",
    )
    left.set_xticks(list(positions))
    left.legend(fontsize=8)
    hist = result["accepted_length_histogram"]
    right.bar(range(len(hist)), hist)
    right.set(
        xlabel="accepted draft tokens per round",
        ylabel="rounds",
        title=f"{result['drafter']}: speedup {result['speedup']:.2f}x",
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tree(result: dict) -> str:
    tree = result.get("tree")
    if not tree:
        return "chain"
    depth = (
        f"mean size {result.get('mean_drafted', 0):.1f}, depth {result.get('mean_depth', 0):.2f}"
    )
    if tree["kind"] == "static":
        return f"static, {len(tree['choices'])} rank paths, {depth}"
    return f"dynamic, top-{tree['top_k']}, budget {tree['budget']}, {depth}"


def rates(values: list) -> str:
    """Rates by position for a table: a position never drafted (None) shows as '-'."""
    return " ".join("-" if a is None else f"{a:.2f}" for a in values)


def curve(values: list) -> list[float]:
    """Rates by position to plot: a position never drafted (None) leaves a gap."""
    return [float("nan") if a is None else a for a in values]
