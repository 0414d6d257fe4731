"""``specdec eval``: many methods over one prompt set, in one process, measured side by side.

Every method (see :mod:`specdec.scoring.methods`) decodes every prompt, for every setting of
the sweep (k, temperature); the prompts are taken round-robin over the sources and, within
each, over its categories; the order of the methods rotates from prompt to prompt, so drift in
the machine's load falls on all of them alike. The first ``warmup`` prompts are decoded and
dropped. Speedups are ratios of total tokens per second against specdec's plain decoding (and
against transformers' ``generate()``), each with a 95% bootstrap interval over prompts. At
T > 0 the acceptance computed from p and q along the decoded text is reported beside the counted
one. Writes ``results.json``, ``report.md`` and the plots into one directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.decoding.compact import target_session
from specdec.decoding.speculative import cheapest_verify_lengths, generate
from specdec.errors import ConfigError
from specdec.scoring import methods as mth
from specdec.scoring import metrics
from specdec.scoring.command import load_prompts
from specdec.scoring.run import (
    ScoreSettings,
    calibrated_tree,
    cost_profile,
    divergence_margins,
    encode_prompt,
    environment,
    summarize,
    tree_spec,
)
from specdec.target import eos_token_ids

logger = logging.getLogger(__name__)

#: built-in suites: packaged prompt pools (each row's ``category`` is its task)
SUITES = {
    "spec": ("mtbench", "humaneval"),  # multi-turn chat by MT-bench category, and code
    "mtbench": ("mtbench",),
    "humaneval": ("humaneval",),
    "chat": ("mtbench", "alpaca_eval", "arena_hard", "ifeval", "writingbench_en"),
}


@dataclass
class EvalJob:
    """What ``specdec eval`` runs. Methods are specs (:func:`specdec.scoring.methods.parse`)."""

    methods: list[str]
    out: str
    prompts: list[str] = field(default_factory=list)
    suite: str | None = None
    category_column: str | None = None
    num_prompts: int = 16
    warmup: int = 1
    ks: list[int] = field(default_factory=lambda: [4])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    target: str | None = None
    dtype: str = "float32"
    cache_dir: str | None = None
    max_ngram: int | None = None
    target_forward: str = "auto"
    draft_forward: str = "auto"
    draft_confidence: float = 0.0
    tree_top_k: int = 4  # the dynamic trees of ``@dynamic`` / ``@static`` methods
    tree_budget: int = 0  # nodes verified; 0: chosen per round from the measured cost
    tree_max_nodes: int = 24
    bootstrap: int = 2000
    certify: int = 0  # samples of the sampling certificate per drafter method (0: greedy only)
    force: bool = False

    def check(self) -> list[mth.Method]:
        """Every setting and method spec, before anything loads. Returns the parsed methods
        (plain and generate first, added when not named)."""
        if bool(self.prompts) == bool(self.suite):
            raise ConfigError("give --prompts FILE or --suite NAME (one of them)")
        if self.suite and self.suite not in SUITES:
            raise ConfigError(f"--suite {self.suite}: unknown; known: {', '.join(SUITES)}")
        for name, value, low in (
            ("--num-prompts", self.num_prompts, 1),
            ("--warmup", self.warmup, 0),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--bootstrap", self.bootstrap, 100),
            ("--certify", self.certify, 0),
            ("--tree-top-k", self.tree_top_k, 1),
            ("--tree-budget", self.tree_budget, 0),
            ("--tree-max-nodes", self.tree_max_nodes, 1),
        ):
            if value < low:
                raise ConfigError(f"{name} {value}: expected >= {low}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise ConfigError(f"--k {self.ks}: expected integers >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ConfigError(f"--temperature {self.temperatures}: expected values >= 0")
        if not 0 <= self.draft_confidence < 1:
            raise ConfigError(f"--draft-confidence {self.draft_confidence}: expected in [0, 1)")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-k {self.top_k} / --top-p {self.top_p}: out of range")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: a file, not a directory")
        if (out / "results.json").exists() and not self.force:
            raise ConfigError(f"--out {out} holds results.json; pass --force to replace it")
        names = [mth.PLAIN, mth.GENERATE] + [m for m in self.methods if m not in (
            mth.PLAIN, mth.GENERATE)]  # fmt: skip
        if len(set(names)) != len(names):
            raise ConfigError(
                f"--method given twice: {sorted(n for n in names if names.count(n) > 1)[0]}"
            )
        methods = [mth.parse(name) for name in names]
        longest = self.max_ngram or drafters.LOOKUP_MAX_NGRAM
        if over := next((m for m in methods if (m.min_ngram or 0) > longest), None):
            raise ConfigError(
                f"method '{over.name}': min_ngram={over.min_ngram} is longer than prompt "
                f"lookup's longest n-gram ({longest}); raise --max-ngram"
            )
        static = next((m.name for m in methods if m.tree == "static"), None)
        if static and self.warmup < 1:
            raise ConfigError(
                f"method '{static}': a static tree is calibrated on the warm-up prompts; "
                "set --warmup 1 or more"
            )
        return methods

    @property
    def sources(self) -> list[str]:
        return list(SUITES[self.suite]) if self.suite else list(self.prompts)


def run_eval(job: EvalJob) -> dict:
    """Run the evaluation; write ``results.json`` (and, through the report module, the
    report and plots). Returns the results."""
    from specdec.target import FrozenTarget

    methods = job.check()
    # prompt files fail here, before any model loads
    rows = load_prompts(
        tuple(job.sources),
        job.warmup + job.num_prompts,
        job.cache_dir,
        job.category_column,
        stratify=True,
    )
    target_spec = job.target or next(
        (m.meta["target"] for m in methods if m.meta.get("target")), "smollm2-135m-instruct"
    )
    mth.check_targets(methods, target_spec)
    target = FrozenTarget.load(target_spec, dtype=job.dtype, cache_dir=job.cache_dir)
    for m in methods:
        mth.load(m, target, job.max_ngram)
        if m.drafter is not None and m.drafter.adapts_target:
            raise ConfigError(
                f"method '{m.name}': its proposals are verified by a model of its own (an "
                "adapted target), not by the target the other methods share; score it with "
                "`specdec score --checkpoint`"
            )
        if m.drafter is not None:
            m.drafter.configure(job.draft_forward, confidence(job, m))
    model, tokenizer = target.model, target.tokenizer
    eos = eos_token_ids(model, tokenizer)
    encoded = [encode_prompt(tokenizer, prompt_messages(r["messages"])) for r in rows]
    sessions = {(): target_session(model, job.target_forward, ())}
    for m in methods:
        layers = tuple(m.drafter.required_target_layers) if m.drafter else ()
        if layers not in sessions:
            sessions[layers] = target_session(model, job.target_forward, layers)
    trees = any(m.tree != "chain" for m in methods)
    longest = max(max(job.ks), job.tree_max_nodes if trees else 0) + 1
    profile = cost_profile(sessions[()], encoded[0], longest)
    started = time.perf_counter()
    configs = []
    for temperature in job.temperatures:
        for k in job.ks:
            settings = ScoreSettings(
                k=k, max_new_tokens=job.max_new_tokens, temperature=temperature,
                top_k=job.top_k, top_p=job.top_p, seed=job.seed,
            )  # fmt: skip
            lengths = cheapest_verify_lengths(profile, k)
            shapes = _configure_trees(job, methods, sessions, encoded, settings, profile, eos)
            gens = _decode_all(job, methods, sessions, encoded, settings, lengths, eos, model)
            kept = [r.get("category") or "all" for r in rows[job.warmup :]]
            summary = {
                m.name: _summarize(m, gens, settings, kept, job, model, encoded) for m in methods
            }
            for name, shape in shapes.items():
                summary[name]["tree"] = shape
            configs.append({"k": k, "temperature": temperature, "methods": summary})
    results = {
        "target": target.name,
        "methods": [m.name for m in methods],
        "prompts": {
            "sources": job.sources,
            "num_prompts": len(rows) - job.warmup,
            "warmup": job.warmup,
            "categories": sorted({r.get("category") or "all" for r in rows[job.warmup :]}),
        },
        "settings": {k: v for k, v in asdict(job).items() if k not in ("methods", "force")},
        "verify_cost_ratio": {m: t / profile[1] for m, t in profile.items()},
        "target_kernels": _kernels(sessions[()]),
        "configs": configs,
        "environment": environment(model),
    }
    results["certificates"] = certify(job, methods, target, encoded[job.warmup :], configs)
    results["seconds"] = time.perf_counter() - started
    return results


def _kernels(session) -> str | None:
    """The target session's matrix-product kernels by row count, where it measured them."""
    linear = getattr(session, "linear", None)
    return linear.describe() if linear is not None else None


def confidence(job: EvalJob, method: mth.Method) -> float:
    """The draft confidence stop of a drafter method: its own ``@confidence=C``, else the run's."""
    return job.draft_confidence if method.confidence is None else method.confidence


def _configure_trees(job, methods, sessions, encoded, settings, profile, eos) -> dict:
    """Give each tree method its tree for this k and temperature: dynamic (depth k, top-k
    children, ``job.tree_budget`` nodes or the cost-chosen number), or static, calibrated from
    that dynamic tree's accepted paths on the warm-up prompts. Returns each tree's description.
    """
    if all(m.tree == "chain" for m in methods):
        return {}
    costs = tuple(profile[m + 1] for m in range(job.tree_max_nodes + 1))
    trees = replace(
        settings, tree="dynamic", tree_top_k=job.tree_top_k, tree_budget=job.tree_budget,
        tree_max_nodes=job.tree_max_nodes,
    )  # fmt: skip
    shapes = {}
    for m in (m for m in methods if m.tree != "chain"):
        tree = tree_spec(replace(trees, draft_confidence=confidence(job, m)), costs)
        m.drafter.configure(job.draft_forward, confidence(job, m), tree)
        if m.tree == "static":
            session = sessions[tuple(m.drafter.required_target_layers)]
            calibration = []
            for i, ids in enumerate(encoded[: job.warmup]):
                generator = torch.Generator(device=session.device).manual_seed(settings.seed + i)
                calibration.append(generate(
                    session, ids, drafter=m.drafter, k=settings.k,
                    max_new_tokens=settings.max_new_tokens, params=settings.params,
                    eos_token_ids=eos, generator=generator,
                ))  # fmt: skip
            tree = calibrated_tree(calibration, costs)
            m.drafter.configure(job.draft_forward, confidence(job, m), tree)
        shapes[m.name] = tree.describe()
    return shapes


def _decode_all(job, methods, sessions, encoded, settings, lengths, eos, model) -> dict:
    """Every method on every prompt, the order rotating per prompt; warm-up prompts dropped."""
    params = settings.params
    gens: dict[str, list] = {m.name: [] for m in methods}
    for i, ids in enumerate(encoded):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        for m in order:
            if m.kind == "transformers":
                g = mth.run_transformers(
                    m, model, ids, k=settings.k, max_new_tokens=settings.max_new_tokens,
                    params=params, eos=eos, seed=settings.seed + i,
                )  # fmt: skip
            else:
                layers = tuple(m.drafter.required_target_layers) if m.drafter else ()
                session = sessions[layers]
                generator = torch.Generator(device=session.device).manual_seed(settings.seed + i)
                g = generate(
                    session, ids, drafter=m.drafter, k=settings.k,
                    max_new_tokens=settings.max_new_tokens, params=params, eos_token_ids=eos,
                    generator=generator,
                    verify_lengths=lengths if m.drafter and m.tree == "chain" else None,
                )  # fmt: skip
            if i >= job.warmup:
                gens[m.name].append(g)
        logger.info(
            "k=%d T=%g: prompt %d/%d", settings.k, settings.temperature, i + 1, len(encoded)
        )
    return gens


def _summarize(m, gens, settings, categories, job, model, encoded) -> dict:
    """One method's numbers in one configuration, overall and per category."""
    own, plain, hf = gens[m.name], gens[mth.PLAIN], gens[mth.GENERATE]
    if m.kind == "drafter":
        out = summarize(own, plain, replace(settings, tree=m.tree))
        out["draft_confidence"] = m.drafter.confidence  # None: a family without the stop
        if settings.temperature == 0:
            out.update(divergence_margins(model, encoded[job.warmup :], plain, out["divergences"]))
    else:
        out = metrics.timing(own, plain)
        if settings.temperature == 0:
            out.update(metrics.greedy_identity(own, plain))
    if settings.temperature == 0:
        out["generate_match_rate"] = metrics.greedy_identity(own, hf)["greedy_match_rate"]
    out["speedup_vs_generate"] = metrics.timing(own, hf)["speedup"]
    # the plain decoding of the method's own runtime: ratios within one runtime share its
    # kernels, so the machine's state moves both sides alike (across runtimes it need not)
    transformers = m.kind == "transformers" or m.name == mth.GENERATE
    out["runtime"] = "transformers" if transformers else "specdec"
    rng = np.random.default_rng(job.seed)
    out["speedup_ci"] = bootstrap_ratio(own, plain, job.bootstrap, rng)
    out["speedup_vs_generate_ci"] = bootstrap_ratio(own, hf, job.bootstrap, rng)
    out["per_prompt"] = {
        "tokens": [len(g.tokens) for g in own],
        "seconds": [g.seconds for g in own],
        "category": categories,
    }
    per = {}
    for cat in sorted(set(categories)):
        idx = [i for i, c in enumerate(categories) if c == cat]
        sub = [own[i] for i in idx], [plain[i] for i in idx]
        row = {"num_prompts": len(idx), **metrics.timing(*sub)}
        row["speedup_ci"] = bootstrap_ratio(*sub, job.bootstrap, rng)
        if m.kind == "drafter":
            row.update(metrics.acceptance(sub[0], settings.k))
        per[cat] = row
    out["per_category"] = per
    return out


def bootstrap_ratio(method, baseline, resamples: int, rng) -> list[float]:
    """95% percentile interval of the ratio of tokens per second, method over baseline, with
    prompts resampled with replacement (the pairs kept together)."""
    a = np.array([[len(g.tokens), g.seconds] for g in method], dtype=float)
    b = np.array([[len(g.tokens), g.seconds] for g in baseline], dtype=float)
    if len(a) < 2:
        return [float("nan"), float("nan")]
    idx = rng.integers(0, len(a), size=(resamples, len(a)))
    sa, sb = a[idx].sum(axis=1), b[idx].sum(axis=1)
    ratios = (sa[:, 0] / sa[:, 1]) / (sb[:, 0] / sb[:, 1])
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def certify(job, methods, target, encoded, configs) -> dict:
    """The losslessness certificate of each drafter method: greedy identity from the first
    T = 0 run (divergences only at recorded near-ties), and with ``job.certify`` samples the
    sampling test at T = 1 on the first (up to) four measured prompts."""
    from specdec.scoring.certificate import (
        greedy_certificate,
        sampling_certificate,
        tie_margin_for,
    )

    out = {}
    greedy = next((c for c in configs if c["temperature"] == 0), None)
    for m in methods:
        if m.kind != "drafter":
            continue
        cert = {}
        if greedy is not None:
            r = greedy["methods"][m.name]
            margin = tie_margin_for(target.model.dtype)
            cert["greedy"] = greedy_certificate(r["divergences"], len(encoded), margin)
        if job.certify:
            cert["sampling"] = sampling_certificate(
                target.model, target.tokenizer, m.drafter, encoded[:4], job.certify,
                k=job.ks[0], temperature=1.0, seed=job.seed, target_forward=job.target_forward,
            )  # fmt: skip
        if cert:
            cert["passed"] = all(c["passed"] for c in cert.values())
            out[m.name] = cert
    return out


def write_results(results: dict, out: Path) -> Path:
    from specdec.files import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    return out / "results.json"


def read_results(path: str | Path) -> dict:
    """A ``results.json`` of an earlier run (``--compare``).

    Raises:
        ConfigError: missing, unreadable or not a results file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--compare {path}: unreadable ({err})") from None
    if not isinstance(data, dict) or "configs" not in data:
        raise ConfigError(f"--compare {path}: not a specdec eval results.json")
    return data
