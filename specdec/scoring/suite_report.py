"""The report of ``specdec eval``: ``report.md`` with its plots, and ``--compare``."""

from __future__ import annotations

import math
from pathlib import Path

from specdec.scoring.report import curve

PLOTS = ("acceptance.png", "categories.png", "speedup_vs_k.png", "accepted_lengths.png")


def write_report(results: dict, out: Path, old: dict | None = None) -> list[Path]:
    """``report.md`` and the plots into ``out``; ``old`` (an earlier results.json) adds the
    comparison. Returns the paths written."""
    from specdec.files import write_text

    plots = _plots(results, out)
    lines = markdown(results, [p.name for p in plots])
    if old is not None:
        lines += ["", "## Compared with the earlier run", "", *compare(old, results)]
    write_text(out / "report.md", "\n".join(lines) + "\n")
    return [out / "report.md", *plots]


def _config_name(c: dict) -> str:
    return f"k={c['k']}, T={c['temperature']:g}"


def _ci(r: dict, key: str = "speedup") -> str:
    lo, hi = r.get(f"{key}_ci", [math.nan, math.nan])
    if math.isnan(lo) or math.isnan(hi):  # one prompt: nothing to resample
        return f"{r[key]:.2f}x"
    return f"{r[key]:.2f}x [{lo:.2f}, {hi:.2f}]"


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _tree(r: dict) -> str:
    tree, size = r["tree"], f"{r.get('mean_drafted') or 0:.1f} nodes"
    if tree["kind"] == "static":
        return f"static, {len(tree['choices'])} paths {tree['choices']}, {size}"
    return f"dynamic, top-{tree['top_k']}, budget {tree['budget']}, {size}"


def markdown(results: dict, plots: list[str]) -> list[str]:
    env, p = results["environment"], results["prompts"]
    lines = [
        f"# specdec eval: {results['target']}",
        "",
        f"- prompts: {p['num_prompts']} from {', '.join(p['sources'])} (+{p['warmup']} "
        f"warm-up), categories: {', '.join(p['categories'])}",
        f"- every method decodes every prompt in one process, the order rotating per prompt; "
        f"max {results['settings']['max_new_tokens']} new tokens; speedups are ratios of "
        "total tokens/s, with 95% bootstrap intervals over prompts; compare a method with "
        "the plain decoding of its own runtime (specdec's decoders: `speedup`; transformers' "
        "methods: `vs generate()`), since ratios across runtimes, which share no kernels, "
        "also move with the machine's state between runs",
        f"- drafters: forward {results['settings']['draft_forward']}, confidence stop "
        f"{results['settings']['draft_confidence']:g} (a method's `@confidence=C` its own); "
        "target forward "
        f"{results['settings']['target_forward']}; verify lengths from the measured cost profile; "
        "c: a draft step's cost over a target forward's, v: a verify forward's",
        f"- environment: {env['device_name']} ({env['device']}, {env['threads']} threads), "
        f"{env['dtype']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"specdec {env['specdec']}",
        f"- wall time: {results.get('seconds', 0):.0f} s",
        "- the target's verify cost v(m), a forward over m new tokens in one-token forwards "
        "(what a chain of k pays at m = k + 1, a tree of n nodes at m = n + 1): "
        + " ".join(f"{m}:{r:.2f}" for m, r in results.get("verify_cost_ratio", {}).items()),
    ]
    if results.get("target_kernels"):
        lines.append(
            "- the target's matrix-product kernels by row count (measured on this host where "
            f"a CPU offers several): {results['target_kernels']}"
        )
    for c in results["configs"]:
        lines += ["", f"## {_config_name(c)}", ""]
        plain = c["methods"]["plain"]
        lines.append(
            f"specdec's plain decoding runs at {plain['tokens_per_second']:.2f} tokens/s, "
            f"{_ci(plain, 'speedup_vs_generate')} the speed of transformers' `generate()`."
        )
        lines += ["", *_table(c)]
        trees = {name: r for name, r in c["methods"].items() if r.get("tree")}
        if trees:
            lines += ["", "Trees verified (nodes a round, on average):", ""]
            lines += [f"- `{name}`: {_tree(r)}" for name, r in trees.items()]
        lines += [
            "",
            "Per category (tau / speedup over plain; an interval where the category has two "
            "prompts or more):",
            "",
            *_category_table(c),
        ]
    certs = results.get("certificates")
    if certs:
        lines += ["", "## Losslessness certificates", ""]
        lines += [
            "| method | greedy identity | sampling test (T=1) | passed |",
            "|---|---|---|---|",
        ]
        for name, cert in certs.items():
            g, s = cert.get("greedy"), cert.get("sampling")
            greedy = "-"
            if g:
                greedy = (
                    f"{g['identical']}/{g['prompts']} identical, {len(g['near_ties'])} near-ties, "
                    f"{len(g['failures'])} failures"
                )
            sampling = "not run (--certify N)"
            if s:
                sampling = (
                    f"{s['samples']} draws, {s['tokens']} tokens: chi-square per context p = "
                    f"{s['context_p_value']:.3g}, PIT p = {s['pit']['p_value']:.3g}; "
                    f"p = {s['p_value']:.3g}"
                )
            lines.append(f"| {name} | {greedy} | {sampling} | {cert['passed']} |")
    lines += ["", *[f"![{Path(p).stem}]({p})" for p in plots]]
    return lines


def _table(c: dict) -> list[str]:
    k = c["k"]
    head = "| method | tau | alpha | E[alpha] | " + " | ".join(f"acc@{i}" for i in range(1, k + 1))
    head += " | c | v | speedup [95% CI] | vs generate() | bound | efficiency | identical |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in c["methods"].items():
        acc = r.get("accept_rate_per_position") or [None] * k
        identical = r.get("greedy_match_rate")
        cells = [
            name,
            _fmt(r.get("tau")),
            _fmt(r.get("alpha")),
            _fmt(r.get("expected_alpha")),
            *[_fmt(a, ".2f") for a in acc],
            _fmt(r.get("c"), ".3f"),
            _fmt(r.get("v"), ".2f"),
            _ci(r),
            _ci(r, "speedup_vs_generate"),
            _fmt(r.get("bound_speedup"), ".2f"),
            _fmt(r.get("efficiency"), ".2f"),
            "-" if identical is None else f"{100 * identical:.0f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _category_table(c: dict) -> list[str]:
    cats = sorted({cat for r in c["methods"].values() for cat in r["per_category"]})
    lines = ["| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
    for name, r in c["methods"].items():
        cells = []
        for cat in cats:
            x = r["per_category"].get(cat)
            cells.append("-" if x is None else f"{_fmt(x.get('tau'), '.2f')} / {_ci(x)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def own_runtime_key(r: dict) -> str:
    """The speedup over the plain decoding of the method's own runtime: specdec's plain for
    specdec's decoders, ``generate()`` for transformers' methods."""
    return "speedup_vs_generate" if r.get("runtime") == "transformers" else "speedup"


def _overlap(o: dict, r: dict, key: str) -> str:
    (a, b), (x, y) = o[f"{key}_ci"], r[f"{key}_ci"]
    return "yes" if a <= y and x <= b else "NO"


def compare(old: dict, new: dict) -> list[str]:
    """What changed from ``old`` to ``new``: tau and speedup of every method in every
    configuration both have, and whether the speedup intervals overlap: over specdec's plain
    decoding, and over the plain decoding of the method's own runtime (the same ratio for
    specdec's decoders; over ``generate()`` for transformers' methods)."""
    before = {(_config_name(c), m): r for c in old["configs"] for m, r in c["methods"].items()}
    lines = [
        "| setting | method | tau before -> after | speedup before -> after | overlap "
        "| over own runtime's plain before -> after | overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in new["configs"]:
        for m, r in c["methods"].items():
            o = before.get((_config_name(c), m))
            own = own_runtime_key(r)
            if o is None:
                new_row = f"| {_config_name(c)} | {m} | new | {_ci(r)} | - | {_ci(r, own)} | - |"
                lines.append(new_row)
                continue
            tau = f"{_fmt(o.get('tau'))} -> {_fmt(r.get('tau'))}"
            lines.append(
                f"| {_config_name(c)} | {m} | {tau} | {_ci(o)} -> {_ci(r)} | "
                f"{_overlap(o, r, 'speedup')} | {_ci(o, own)} -> {_ci(r, own)} | "
                f"{_overlap(o, r, own)} |"
            )
    gone = {key for key in before} - {
        (_config_name(c), m) for c in new["configs"] for m in c["methods"]
    }
    lines += [f"| {cfg} | {m} | gone | - | - | - | - |" for cfg, m in sorted(gone)]
    return lines


def _plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    configs, written = results["configs"], []
    drafting = [
        m for m in results["methods"] if "accept_rate_per_position" in configs[0]["methods"][m]
    ]

    fig, axes = plt.subplots(1, len(configs), figsize=(4.5 * len(configs), 3.6), squeeze=False)
    for ax, c in zip(axes[0], configs, strict=True):
        for m in drafting:
            r = c["methods"][m]
            pos = range(1, c["k"] + 1)
            (line,) = ax.plot(pos, curve(r["accept_rate_per_position"]), "o-", label=m)
            if r.get("expected_accept_rate_per_position"):
                expected = curve(r["expected_accept_rate_per_position"])
                ax.plot(pos, expected, ":", color=line.get_color())
        ax.set(title=_config_name(c), xlabel="draft position i", ylabel="P(accepted >= i)")
        ax.set_ylim(0, 1.05)
    axes[0][0].legend(fontsize=7)
    written.append(_save(fig, out / PLOTS[0], plt))

    fig, axes = plt.subplots(len(configs), 2, figsize=(11, 3.4 * len(configs)), squeeze=False)
    for row, c in zip(axes, configs, strict=True):
        cats = sorted({cat for r in c["methods"].values() for cat in r["per_category"]})
        shown = [m for m in results["methods"] if m != "plain"]
        width = 0.8 / max(len(shown), 1)
        for j, m in enumerate(shown):
            per = c["methods"][m]["per_category"]
            xs = [i + j * width for i in range(len(cats))]
            color = f"C{j}"  # one colour per method in both panels
            if m in drafting:
                row[0].bar(xs, [per[x].get("tau", 0) for x in cats], width, color=color)
            row[1].bar(xs, [per[x]["speedup"] for x in cats], width, label=m, color=color)
        for ax, what in zip(row, ("tau", "speedup over plain"), strict=True):
            ax.set_xticks(
                [i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, fontsize=7
            )
            ax.set(title=f"{what}, {_config_name(c)}")
        row[1].axhline(1.0, color="grey", lw=0.8)
        row[1].legend(fontsize=7)
    written.append(_save(fig, out / PLOTS[1], plt))

    ks = sorted({c["k"] for c in configs})
    if len(ks) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in sorted({c["temperature"] for c in configs}):
            for m in results["methods"]:
                if m == "plain":
                    continue
                rs = [
                    c["methods"][m]
                    for k in ks
                    for c in configs
                    if c["k"] == k and c["temperature"] == t
                ]
                lo = [r["speedup"] - r["speedup_ci"][0] for r in rs]
                hi = [r["speedup_ci"][1] - r["speedup"] for r in rs]
                ax.errorbar(
                    ks,
                    [r["speedup"] for r in rs],
                    yerr=[lo, hi],
                    marker="o",
                    capsize=3,
                    label=f"{m}, T={t:g}",
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="k (draft tokens per round)", ylabel="speedup over plain (95% CI)")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / PLOTS[2], plt))

    fig, axes = plt.subplots(1, len(configs), figsize=(4.5 * len(configs), 3.6), squeeze=False)
    for ax, c in zip(axes[0], configs, strict=True):
        width = 0.8 / max(len(drafting), 1)
        for j, m in enumerate(drafting):
            hist = c["methods"][m]["accepted_length_histogram"]
            total = sum(hist) or 1
            ax.bar(
                [n + j * width for n in range(len(hist))], [h / total for h in hist], width, label=m
            )
        ax.set(
            title=_config_name(c),
            xlabel="accepted draft tokens per round",
            ylabel="share of rounds",
        )
    axes[0][0].legend(fontsize=7)
    written.append(_save(fig, out / PLOTS[3], plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
