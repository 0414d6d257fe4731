"""Score a drafter: decode held-out prompts with it and without it, in one run, and measure.

Plain decoding and speculative decoding run through the same loop (see
:mod:`specdec.decoding.speculative`), prompt by prompt interleaved so that drift in machine load
hits both alike, after warm-up prompts whose timings are dropped. The verify cost profile (the
target's forward time for 1..k+1 new tokens) is measured here too, because on a CPU the cost
of a forward is not monotonic in its length.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.data.chat import prompt_messages
from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import Generation, cheapest_verify_lengths, generate
from specdec.drafters.base import Drafter
from specdec.drafters.tree import TREE_KINDS, TreeSpec, calibrated_choices, check_choices
from specdec.errors import ConfigError
from specdec.scoring import metrics
from specdec.target import eos_token_ids

logger = logging.getLogger(__name__)


@dataclass
class ScoreSettings:
    """How to score. ``k`` draft tokens per round; sampling settings as in decoding."""

    k: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    warmup_prompts: int = 1
    #: pad short drafts up to the cheapest verify length of the measured cost profile
    shape_verify: bool = True
    #: how a draft model runs (``DRAFT_FORWARDS``): auto is the compact float16 forward on a CPU
    draft_forward: str = "auto"
    #: how the target runs, for plain and speculative decoding alike (``TARGET_FORWARDS``)
    target_forward: str = "auto"
    #: a draft model stops drafting when its chain's probability falls below this (0: never)
    draft_confidence: float = 0.0
    #: chain, static or dynamic (see ``EvalConfig.tree``)
    tree: str = "chain"
    tree_top_k: int = 4
    tree_budget: int = 0
    tree_max_nodes: int = 24
    tree_choices: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_eval(cls, ev, **more) -> ScoreSettings:
        """The settings of a recipe's ``eval`` section (the fields both have)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ev).items() if k in names}, **more)

    def check(self) -> None:
        if self.k < 1:
            raise ConfigError(f"k: must be >= 1, got {self.k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 <= self.draft_confidence < 1:
            raise ConfigError(f"draft_confidence: must be in [0, 1), got {self.draft_confidence}")
        if self.tree not in TREE_KINDS:
            raise ConfigError(f"tree: expected one of {', '.join(TREE_KINDS)}, got {self.tree!r}")
        if self.tree_choices:
            try:
                check_choices(self.tree_choices)
            except ValueError as err:
                raise ConfigError(str(err).replace("tree choices", "tree_choices")) from None
        elif self.tree == "static" and self.warmup_prompts < 1:
            raise ConfigError(
                "tree_choices: a static tree without choices is calibrated on the warm-up "
                "prompts; set warmup_prompts >= 1 or give the choices"
            )

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids as the target sees them: its chat template with the generation prompt, or
    the raw text of a model without a template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def cost_profile(
    session: ModelSession, prompt: Sequence[int], max_tokens: int, repeats: int = 9
) -> dict[int, float]:
    """Median seconds of one cached target forward over m = 1..max_tokens new tokens.

    The sizes are measured in rounds (1, 2, ..., max_tokens, then again), the first round only
    warming up, so that a drift in the machine's speed while measuring falls on every size
    alike: measured size after size, the first sizes also paid for a cold start, and the
    verify lengths chosen from the profile changed from run to run."""
    session.reset()
    session.extend(list(prompt))
    base = session.length
    probe = (list(prompt) * (max_tokens // max(len(prompt), 1) + 1))[:max_tokens]
    times: dict[int, list[float]] = {m: [] for m in range(1, max_tokens + 1)}
    for _ in range(repeats + 1):
        for m in times:
            t0 = session.clock()
            session.extend(probe[:m])
            times[m].append(session.clock() - t0)
            session.rollback(base)
    return {m: statistics.median(t[1:]) for m, t in times.items()}


def score(
    model,
    tokenizer,
    drafter: Drafter,
    prompts: Sequence[dict],
    settings: ScoreSettings,
) -> dict:
    """Decode every prompt with plain decoding and with ``drafter``; return the measurements.

    Args:
        model: the target causal LM.
        tokenizer: the target's tokenizer (chat template used for the prompts).
        drafter: the drafter under test.
        prompts: rows with ``messages`` and optionally ``category``.
        settings: k, sampling, lengths, seed and warm-up.

    Returns:
        The score dictionary written to score.json (see :mod:`specdec.scoring.metrics`).
    """
    settings.check()
    params = settings.params
    chain = settings.tree == "chain"
    drafter.configure(settings.draft_forward, settings.draft_confidence)
    original, model = model, drafter.verifier(model)  # both plain and speculative decode it
    eos = eos_token_ids(model, tokenizer)
    target = target_session(model, settings.target_forward, drafter.required_target_layers)
    encoded = [encode_prompt(tokenizer, prompt_messages(row["messages"])) for row in prompts]
    warm = min(settings.warmup_prompts, max(len(encoded) - 1, 0))
    device = target.device

    longest = settings.k + 1 if chain else max(settings.k, settings.tree_max_nodes) + 1
    profile = cost_profile(target, encoded[0], longest)
    shaped = settings.shape_verify and chain
    lengths = cheapest_verify_lengths(profile, settings.k) if shaped else None

    def run(ids: list[int], with_drafter: bool, index: int) -> Generation:
        gen = torch.Generator(device=device).manual_seed(settings.seed + index)
        return generate(
            target,
            ids,
            drafter=drafter if with_drafter else None,
            k=settings.k,
            max_new_tokens=settings.max_new_tokens,
            params=params,
            eos_token_ids=eos,
            generator=gen,
            verify_lengths=lengths if with_drafter else None,
        )

    tree = None
    if not chain:
        costs = tuple(profile[m + 1] for m in range(settings.tree_max_nodes + 1))
        tree = tree_spec(settings, costs)
        if settings.tree == "static" and not settings.tree_choices:
            drafter.configure(settings.draft_forward, settings.draft_confidence, tree)
            calibration = [run(ids, True, i) for i, ids in enumerate(encoded[:warm])]
            tree = calibrated_tree(calibration, costs)
        drafter.configure(settings.draft_forward, settings.draft_confidence, tree)

    method, baseline = [], []
    for i, ids in enumerate(encoded):
        b = run(ids, False, i)
        m = run(ids, True, i)
        if i >= warm:
            baseline.append(b)
            method.append(m)
        logger.info(
            "prompt %d/%d: %d tokens, %d rounds, tau %.2f",
            i + 1,
            len(encoded),
            len(m.tokens),
            len(m.drafted),
            m.decode_tokens / max(len(m.drafted), 1),
        )
    kept = list(prompts)[warm:]
    result = summarize(method, baseline, settings)
    result["cost_profile_seconds"] = profile
    result["verify_lengths"] = lengths
    result["cost_profile_ratio"] = {m: t / profile[1] for m, t in profile.items()}
    result.update(divergence_margins(model, encoded[warm:], baseline, result["divergences"]))
    if model is not original:
        result["verifier"] = adaptation_report(original, model, encoded[warm:], baseline)
    if settings.temperature == 0:
        from specdec.scoring.certificate import greedy_certificate, tie_margin_for

        margin = tie_margin_for(next(model.parameters()).dtype)
        greedy = greedy_certificate(result["divergences"], len(baseline), margin)
        result["certificate"] = {"greedy": greedy, "passed": greedy["passed"]}
    result["per_category"] = _per_category(kept, method, baseline, settings)
    result["num_prompts"] = len(kept)
    result["warmup_prompts"] = warm
    result["settings"] = vars(settings).copy()
    result["drafter"] = drafter.name
    result["tree"] = tree.describe() if tree is not None else None
    # what the drafter applied of the settings (prompt lookup has no forward or confidence)
    result["draft_forward"] = drafter.forward
    result["draft_confidence"] = drafter.confidence
    result["environment"] = environment(model)
    return result


def tree_spec(settings: ScoreSettings, verify_costs: tuple[float, ...]) -> TreeSpec:
    """The tree the settings ask for. A static tree without choices starts as the dynamic
    tree whose accepted paths calibrate it (see :func:`score`)."""
    if settings.tree == "static" and settings.tree_choices:
        choices = tuple(tuple(c) for c in settings.tree_choices)
        return TreeSpec("static", choices, verify_costs=verify_costs)
    return TreeSpec(
        "dynamic",
        top_k=settings.tree_top_k,
        budget=min(settings.tree_budget, settings.tree_max_nodes),
        verify_costs=verify_costs,
        confidence=settings.draft_confidence,
    )


def calibrated_tree(calibration: Sequence[Generation], verify_costs: tuple[float, ...]) -> TreeSpec:
    """The static tree of the rank paths accepted in ``calibration``'s tree rounds (see
    :func:`specdec.drafters.tree.calibrated_choices`)."""
    paths = [p for g in calibration for p in g.paths]
    choices = calibrated_choices(paths, len(paths), verify_costs)
    return TreeSpec("static", choices, verify_costs=verify_costs)


def summarize(method: list[Generation], baseline: list[Generation], settings) -> dict:
    """Acceptance, timing, cost ratios, bound and identity for matched generations."""
    out = metrics.acceptance(method, settings.k)
    out.update(metrics.expected_acceptance(method, settings.k))  # None at T = 0
    out.update(metrics.timing(method, baseline))
    step = out["target_step_seconds"]
    # c: one draft forward (a chain drafts a token per forward, a tree a depth per forward)
    per_draft = out["draft_seconds_per_round"] / out["mean_depth"] if out["mean_depth"] else 0
    out["c"] = per_draft / step if step else 0.0
    out["v"] = out["verify_seconds_per_round"] / step if step else 0.0
    if getattr(settings, "tree", "chain") != "chain":
        # a tree: the accepted length per round over the round's measured forwards
        cost = out["mean_depth"] * out["c"] + out["v"]
        out["bound_speedup"] = out["tau"] / cost if cost else 0.0
    else:
        # drafts shorter than k (prompt lookup without a match, a confidence stop): the bound
        # at the mean draft length
        drafted = min(out["mean_drafted"], settings.k) if out["rounds"] else settings.k
        out["bound_speedup"] = metrics.speedup_bound(out["alpha"], drafted, out["c"], out["v"])
    out["efficiency"] = out["speedup"] / out["bound_speedup"] if out["bound_speedup"] else 0.0
    out.update(metrics.greedy_identity(method, baseline))
    if settings.temperature > 0:
        out["greedy_match_rate"] = None  # sampled outputs are not expected to match
        out["divergences"] = []
    return out


def _per_category(rows, method, baseline, settings) -> dict:
    categories = sorted({row.get("category") for row in rows if row.get("category")})
    per = {}
    for cat in categories:
        idx = [i for i, row in enumerate(rows) if row.get("category") == cat]
        s = summarize([method[i] for i in idx], [baseline[i] for i in idx], settings)
        keep = ("tau", "alpha", "speedup", "greedy_match_rate", "accept_rate_per_position")
        per[cat] = {key: s[key] for key in keep} | {"num_prompts": len(idx)}
    return per


@torch.inference_mode()
def adaptation_report(original, adapted, encoded, baseline) -> dict:
    """How far a drafter's adapted verifier is from the target, on the held-out prompts and
    the adapted model's own plain continuations of them: the mean per-token KL(target ||
    adapted) and how often their top tokens agree, over the continuation's positions."""
    device = next(adapted.parameters()).device
    kl, agree, count = 0.0, 0, 0
    for prompt, gen in zip(encoded, baseline, strict=True):
        ids = torch.tensor([list(prompt) + gen.tokens], device=device)
        rows = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict gen
        p = torch.log_softmax(original(ids).logits[0, rows].float(), -1)
        q = torch.log_softmax(adapted(ids).logits[0, rows].float(), -1)
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return {
        "kind": "adapted",
        "kl_to_target": kl / max(count, 1),
        "top1_agreement": agree / max(count, 1),
        "tokens": count,
        "note": "the output is the drafter's adapted model's, not the original target's; "
        "speedup is over that model's own plain decoding",
    }


def divergence_margins(model, encoded, baseline, divergences) -> dict:
    """At each greedy divergence, the target's top-2 logit margin: a tiny margin means the
    two runs differ by floating-point noise between verify and single-token forwards."""
    for d in divergences:
        tokens = encoded[d["prompt"]] + baseline[d["prompt"]].tokens[: d["position"]]
        device = next(model.parameters()).device
        logits = model(torch.tensor([tokens], device=device)).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        d["top2_margin"] = float(top2[0] - top2[1])
    return {"divergences": divergences}


def environment(model) -> dict:
    import transformers

    import specdec

    param = next(model.parameters())
    return {
        "specdec": specdec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(param.device),
        "device_name": torch.cuda.get_device_name(param.device) if param.is_cuda else _cpu_name(),
        "threads": torch.get_num_threads(),
        "dtype": str(param.dtype).replace("torch.", ""),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor()
