"""Losslessness certificates: evidence that speculative decoding changed the output's law only
in speed, checked on the real target a drafter is scored with.

Greedy (temperature 0): speculative output must equal plain decoding token for token. A
divergence is explained only where the target's top-2 logit margin is within floating-point
noise, since the verify forward over several tokens and the one-token forward of plain decoding
round differently; any other divergence is a failure.

Sampling: speculative sampling emits exactly the target's distribution (Leviathan et al. 2023,
Theorem 1; Chen et al. 2023). :func:`sampling_certificate` decodes three tokens per draw with
specdec's own decoder, so the first round drafts one token: t1 comes from the prefill, t2 is
decided by the acceptance test (accepted draft or residual resample) and t3 is the bonus token
or a plain step. The law of each t_i given what precedes it is computed exactly from one target
forward per context, and the observed counts are compared with it by Pearson's chi-square test
pooled over contexts (Anderson and Goodman 1957), so the reference is never sampled.

All draws of one prompt share the prompt's forward (:class:`PromptOnce`): the target's cache
entries of the prompt are what a fresh prefill writes, so a draw costs the few forwards of its
three tokens, not a prefill; the draws are exactly those of fresh sessions (tested).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from inspect import signature

import torch

from specdec.decoding.compact import target_session
from specdec.decoding.sampling import SamplingParams, probabilities
from specdec.decoding.speculative import generate
from specdec.drafters.base import Drafter

#: top-2 logit margin below which a greedy divergence is floating-point noise. In float32 on a
#: CPU a multi-token verify forward and a one-token forward differ by ~1e-5..1e-4 in the
#: logits (different GEMM shapes sum in different orders); 1e-3 leaves 10x headroom and is
#: still far below any margin a model means.
TIE_MARGIN = 1e-3
#: per dtype: in half precision one rounding of a logit near 10 is already 2^-7 (float16) or
#: 2^-4 (bfloat16), so the noise floor is about an ulp there; anything wider is a failure
TIE_MARGINS = {torch.float32: TIE_MARGIN, torch.float16: 1e-2, torch.bfloat16: 1e-1}
#: the usual validity rule of the chi-square approximation: cells expect at least 5 counts
MIN_EXPECTED = 5.0
#: tokens per draw: the prefill's token, one drafted round's decided token, its bonus
NEW_TOKENS = 3


def tie_margin_for(dtype: torch.dtype) -> float:
    """The greedy tie margin for a target running in ``dtype`` (float32's for others)."""
    return TIE_MARGINS.get(dtype, TIE_MARGIN)


def greedy_certificate(
    divergences: list[dict], num_prompts: int, tie_margin: float = TIE_MARGIN
) -> dict:
    """Check greedy speculative outputs against plain decoding.

    Args:
        divergences: the first divergence of each prompt that diverged, as ``score()`` records
            them: ``{"prompt", "position", "top2_margin"}`` (a missing margin is unexplained).
        num_prompts: how many prompts were compared.
        tie_margin: the largest top-2 logit margin a divergence may have to be explained as
            a near-tie (see :func:`tie_margin_for`).

    Returns:
        ``{"prompts", "identical", "near_ties", "failures", "passed"}``; near_ties and failures
        list the divergence dicts.
    """
    near_ties, failures = [], []
    for d in divergences:
        margin = d.get("top2_margin")
        (near_ties if margin is not None and margin <= tie_margin else failures).append(d)
    diverged = {d["prompt"] for d in divergences}
    return {
        "prompts": num_prompts,
        "identical": num_prompts - len(diverged),
        "near_ties": near_ties,
        "failures": failures,
        "passed": not failures,
    }


def sampling_certificate(
    model,
    tokenizer,
    drafter: Drafter,
    prompts: list[list[int]],
    samples: int,
    *,
    k: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    target_forward: str = "auto",
    alpha_level: float = 1e-3,
) -> dict:
    """Test that speculative sampling with ``drafter`` draws from the target's distribution.

    Args:
        model: the target causal LM (the reference comes from its own forward).
        tokenizer: unused (the prompts are token ids); taken so that calls read as ``score``'s.
        drafter: the drafter under test, configured as it will be scored.
        prompts: prompt token ids; ``samples // len(prompts)`` draws each.
        samples: total draws.
        k: draft tokens per round (a 3-token draw's first round drafts one token for any k).
        temperature, top_k, top_p: the sampling settings (temperature > 0).
        seed: every draw has its own generator, seeded from this.
        target_forward: how the decoder runs the target (``TARGET_FORWARDS``).
        alpha_level: the test's level: it fails when the p-value is below it.

    Returns:
        ``{"samples", "prompts", "statistic", "dof", "p_value", "alpha", "passed",
        "groups_tested", "groups_skipped", "accept_rate", "outside_support", "seconds",
        "method"}``; it fails too when nothing had enough draws to be tested (dof 0).
    """
    if not prompts or samples < len(prompts):
        raise ValueError(f"need at least one draw per prompt: {samples} for {len(prompts)}")
    params = SamplingParams(temperature, top_k, top_p)
    if params.greedy:
        raise ValueError("sampling_certificate needs temperature > 0; use greedy_certificate")
    start = time.perf_counter()
    per_prompt = samples // len(prompts)
    target = PromptOnce(target_session(model, target_forward, drafter.required_target_layers))
    seeds = torch.randint(
        0, 2**62, (len(prompts), per_prompt), generator=torch.Generator().manual_seed(seed)
    )
    statistic, dof, tested, skipped, outside, accepted, drafted = 0.0, 0, 0, 0, 0, 0, 0
    for prompt, row in zip(prompts, seeds.tolist(), strict=True):
        draws, rounds = _draw(target, drafter, prompt, row, k, params)
        drafted, accepted = drafted + rounds[0], accepted + rounds[1]
        for depth in range(NEW_TOKENS):
            result = _test_depth(model, prompt, draws, depth, params)
            statistic, dof = statistic + result[0], dof + result[1]
            tested, skipped, outside = tested + result[2], skipped + result[3], outside + result[4]
    p_value = chi2_sf(statistic, dof) if dof else 1.0
    return {
        "samples": per_prompt * len(prompts),
        "prompts": len(prompts),
        "statistic": statistic,
        "dof": dof,
        "p_value": p_value,
        "alpha": alpha_level,
        "passed": dof > 0 and p_value >= alpha_level,
        "groups_tested": tested,
        "groups_skipped": skipped,
        "accept_rate": accepted / drafted if drafted else None,
        "outside_support": outside,
        "seconds": time.perf_counter() - start,
        "method": (
            f"Pearson chi-square of t1 | prompt, t2 | prompt+t1 and t3 | prompt+t1+t2 over "
            f"{NEW_TOKENS}-token speculative draws against the target's exact processed "
            f"probabilities (one forward per context), cells expecting < {MIN_EXPECTED:g} "
            "merged, pooled over contexts"
        ),
    }


class PromptOnce:
    """A target session that runs a prompt's forward once for many decodes of it.

    ``generate`` resets the session and extends it by the prompt; when the prompt is the one
    read last, the cache is rolled back to it (its entries are never rewritten: every round
    keeps the whole sequence) and the prefill's logits and features are returned again.
    Everything else is the wrapped session's.
    """

    def __init__(self, session):
        self.session = session
        self.fresh = False
        self.prompt: list[int] | None = None
        self.logits: torch.Tensor | None = None
        self.features: dict = {}

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    def reset(self) -> None:
        self.fresh = True

    def extend(self, tokens, last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        if not self.fresh:
            return self.session.extend(tokens, last_only, positions, mask)
        self.fresh = False
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        plain = last_only and positions is None and mask is None
        if plain and ids == self.prompt:
            self.session.rollback(len(ids))
            self.session.hidden = dict(self.features)
            return self.logits
        self.session.reset()
        logits = self.session.extend(tokens, last_only, positions, mask)
        self.prompt = ids if plain else None
        self.logits, self.features = logits.clone(), dict(self.session.hidden)
        return logits


def _draw(target, drafter, prompt, seeds: list[int], k: int, params) -> tuple:
    """One speculative draw of :data:`NEW_TOKENS` tokens per seed, each with its own generator
    (no EOS: the law of the tokens does not depend on where decoding would stop).

    Returns:
        ``(draws, (drafted, accepted))``: the token tuples, and the first rounds' totals.
    """
    draws, drafted, accepted = [], 0, 0
    for seed in seeds:
        generator = torch.Generator(device=target.device).manual_seed(seed)
        gen = generate(
            target,
            prompt,
            drafter=drafter,
            k=k,
            max_new_tokens=NEW_TOKENS,
            params=params,
            generator=generator,
        )
        draws.append(tuple(gen.tokens))
        drafted += gen.drafted[0] if gen.drafted else 0
        accepted += gen.accepted[0] if gen.accepted else 0
    return draws, (drafted, accepted)


def _test_depth(model, prompt: list[int], draws: list[tuple], depth: int, params) -> tuple:
    """The chi-square of token ``depth`` of ``draws`` against the target's law given the prompt
    and the tokens before it, pooled over those prefixes.

    Returns:
        ``(statistic, dof, groups tested, groups skipped, draws where p is 0)``.
    """
    groups = Counter(d[:depth] for d in draws if len(d) > depth)
    contexts = [c for c, n in groups.items() if n >= 2 * MIN_EXPECTED]
    skipped = len(groups) - len(contexts)
    if not contexts:
        return 0.0, 0, 0, skipped, 0
    p = exact_probabilities(model, [list(prompt) + list(c) for c in contexts], params)
    statistic, dof, tested, outside = 0.0, 0, 0, 0
    for context, row in zip(contexts, p, strict=True):
        tokens = torch.tensor([d[depth] for d in draws if d[:depth] == context])
        observed = torch.bincount(tokens, minlength=row.shape[0]).double()
        outside += int(observed[row == 0].sum())
        cells = pearson(observed, len(tokens) * row)
        if cells is None:
            skipped += 1
            continue
        statistic, dof, tested = statistic + cells[0], dof + cells[1], tested + 1
    return statistic, dof, tested, skipped, outside


@torch.inference_mode()
def exact_probabilities(
    model, contexts: Sequence[Sequence[int]], params: SamplingParams, batch: int = 64
) -> torch.Tensor:
    """``[N, V]`` float64: the target's processed next-token law after each context, from a
    plain forward of the model (no cache, no session) over batches of equal-length contexts."""
    device = next(model.parameters()).device
    keep = {"logits_to_keep": 1} if "logits_to_keep" in signature(model.forward).parameters else {}
    rows = [None] * len(contexts)
    for length in sorted({len(c) for c in contexts}):
        same = [i for i, c in enumerate(contexts) if len(c) == length]
        for index in (same[j : j + batch] for j in range(0, len(same), batch)):
            ids = torch.tensor([list(contexts[i]) for i in index], device=device)
            logits = model(input_ids=ids, **keep).logits[:, -1]  # [n, V]
            for i, p in zip(index, probabilities(logits, params).double().cpu(), strict=True):
                rows[i] = p
    return torch.stack(rows)


def pearson(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int] | None:
    """Pearson's statistic and degrees of freedom of ``[V]`` counts against ``[V]`` expected
    counts, the cells expecting under :data:`MIN_EXPECTED` merged into one (joined by the next
    smallest cell while that one still expects too little); None when fewer than 2 cells stay.
    """
    order = expected.argsort()
    observed, expected = observed[order], expected[order]
    small = int((expected < MIN_EXPECTED).sum())
    if small:
        if expected[:small].sum() < MIN_EXPECTED and small < len(expected):
            small += 1
        observed = torch.cat([observed[:small].sum(0, keepdim=True), observed[small:]])
        expected = torch.cat([expected[:small].sum(0, keepdim=True), expected[small:]])
    if len(expected) < 2:
        return None
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularised upper incomplete gamma
    Q(dof / 2, statistic / 2), in float64 (scipy is not a dependency of the library)."""
    a = torch.tensor(dof / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2, dtype=torch.float64)))
