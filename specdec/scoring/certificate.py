"""Losslessness certificates: evidence that speculative decoding changed the output's law only
in speed, checked on the real target a drafter is scored with.

Greedy (temperature 0): speculative output must equal plain decoding token for token. A
divergence is explained only where the target's top-2 logit margin is within floating-point
noise, since the verify forward over several tokens and the one-token forward of plain decoding
round differently; any other divergence is a failure.

Sampling: speculative sampling emits exactly the target's distribution (Leviathan et al. 2023,
Theorem 1; Chen et al. 2023). :func:`sampling_certificate` draws ``new_tokens`` tokens per draw
with specdec's own decoder and tests them against the target's exact law, computed by a plain
forward of the model (no cache, no session), two ways; the reference is never sampled:

- *per context*: the first three tokens (t1 from the prefill, t2 and t3 decided by the first
  round's acceptance test, residual resample or bonus), grouped by the tokens before them;
  Pearson's chi-square of the counts, pooled over contexts (Anderson and Goodman 1957). Sharp
  where contexts repeat (a small model's law); on a real target few do beyond t1.
- *every token*: the randomised probability integral transform. Order the vocabulary by the
  target's probability, highest first; a token x drawn from p gives
  U = P(tokens before x) + V p(x) with V ~ Uniform(0, 1) independent, which is Uniform(0, 1)
  given everything before it, so the U of all tokens of all draws are independent uniforms
  (Rosenblatt 1952; randomised for discrete laws as in Brockwell 2007). A decoder whose law at
  a context is P != p gives U the density P(x) / p(x) on x's interval instead; the
  Kolmogorov-Smirnov test compares the pooled U with the uniform law. It uses every token, so
  its power grows with the draw length, not with repeated contexts: a decoder that favours the
  target's likely tokens (or its unlikely ones) shifts U down (up) at every position.

The certificate fails when either test, Bonferroni-corrected, rejects at its level. Tokens the
reference gives probability 0 are counted (``outside_support``), not failed on their own: at a
top-k / top-p cut-off the cached forward and the plain one may round a boundary token apart.

All draws of one prompt share the prompt's forward (:class:`PromptOnce`): the target's cache
entries of the prompt are what a fresh prefill writes, so a draw costs the few forwards of its
own tokens, not a prefill; the draws are exactly those of fresh sessions (tested).
"""

from __future__ import annotations

import math
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
#: tokens of each draw in the per-context test: the prefill's token and the first round's next
#: two (where they repeat often enough to be tested)
CONTEXT_TOKENS = 3


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
    new_tokens: int = 16,
) -> dict:
    """Test that speculative sampling with ``drafter`` draws from the target's distribution.

    Args:
        model: the target causal LM (the reference comes from its own forward).
        tokenizer: unused (the prompts are token ids); taken so that calls read as ``score``'s.
        drafter: the drafter under test, configured as it will be scored.
        prompts: prompt token ids; ``samples // len(prompts)`` draws each.
        samples: total draws.
        k: draft tokens per round.
        temperature, top_k, top_p: the sampling settings (temperature > 0).
        seed: every draw has its own generator, seeded from this; so has the PIT's V.
        target_forward: how the decoder runs the target (``TARGET_FORWARDS``).
        alpha_level: the certificate's level: it fails when the p-value is below it.
        new_tokens: tokens per draw (at least :data:`CONTEXT_TOKENS`).

    Returns:
        ``{"samples", "prompts", "tokens", "p_value", "alpha", "passed", "accept_rate",
        "outside_support", "seconds", "method", "statistic", "dof", "context_p_value",
        "groups_tested", "groups_skipped", "pit"}``: p_value is the Bonferroni-corrected
        smaller of the two tests' (the per-context chi-square's statistic, dof and p-value, and
        ``pit = {"tokens", "ks", "p_value", "mean_u"}``); accept_rate is over all rounds.
    """
    if not prompts or samples < len(prompts):
        raise ValueError(f"need at least one draw per prompt: {samples} for {len(prompts)}")
    if new_tokens < CONTEXT_TOKENS:
        raise ValueError(f"new_tokens must be at least {CONTEXT_TOKENS}, got {new_tokens}")
    params = SamplingParams(temperature, top_k, top_p)
    if params.greedy:
        raise ValueError("sampling_certificate needs temperature > 0; use greedy_certificate")
    start = time.perf_counter()
    per_prompt = samples // len(prompts)
    target = PromptOnce(target_session(model, target_forward, drafter.required_target_layers))
    seeds = torch.randint(
        0, 2**62, (len(prompts), per_prompt), generator=torch.Generator().manual_seed(seed)
    )
    uniform = torch.Generator().manual_seed(seed + 1)
    statistic, dof, tested, skipped, outside, accepted, drafted = 0.0, 0, 0, 0, 0, 0, 0
    pits = []
    for prompt, row in zip(prompts, seeds.tolist(), strict=True):
        draws, rounds = _draw(target, drafter, prompt, row, k, params, new_tokens)
        drafted, accepted = drafted + rounds[0], accepted + rounds[1]
        for depth in range(CONTEXT_TOKENS):
            result = _test_depth(model, prompt, draws, depth, params)
            statistic, dof = statistic + result[0], dof + result[1]
            tested, skipped = tested + result[2], skipped + result[3]
        u, zero = pit_of_draws(model, prompt, draws, params, uniform)
        pits.append(u)
        outside += zero
    u = torch.cat(pits)
    ks = ks_uniform(u)
    pit_p = kolmogorov_sf(ks * len(u) ** 0.5)
    context_p = chi2_sf(statistic, dof) if dof else 1.0
    p_value = min(1.0, 2 * min(pit_p, context_p))
    return {
        "samples": per_prompt * len(prompts),
        "prompts": len(prompts),
        "tokens": len(u),
        "p_value": p_value,
        "alpha": alpha_level,
        "passed": p_value >= alpha_level,
        "accept_rate": accepted / drafted if drafted else None,
        "outside_support": outside,
        "seconds": time.perf_counter() - start,
        "method": (
            f"{new_tokens}-token speculative draws against the target's exact processed law "
            "(a plain forward of the model): Pearson chi-square of t1 | prompt, t2 | prompt+t1 "
            f"and t3 | prompt+t1+t2 (cells expecting < {MIN_EXPECTED:g} merged, pooled over "
            "contexts) and Kolmogorov-Smirnov of every token's randomised probability integral "
            "transform against Uniform(0, 1); p-value the smaller of the two, times 2"
        ),
        "statistic": statistic,
        "dof": dof,
        "context_p_value": context_p,
        "groups_tested": tested,
        "groups_skipped": skipped,
        "pit": {"tokens": len(u), "ks": ks, "p_value": pit_p, "mean_u": float(u.mean())},
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


def _draw(target, drafter, prompt, seeds: list[int], k: int, params, new_tokens: int) -> tuple:
    """One speculative draw of ``new_tokens`` tokens per seed, each with its own generator
    (no EOS: the law of the tokens does not depend on where decoding would stop).

    Returns:
        ``(draws, (drafted, accepted))``: the token tuples, and all rounds' totals.
    """
    draws, drafted, accepted = [], 0, 0
    for seed in seeds:
        generator = torch.Generator(device=target.device).manual_seed(seed)
        gen = generate(
            target,
            prompt,
            drafter=drafter,
            k=k,
            max_new_tokens=new_tokens,
            params=params,
            generator=generator,
        )
        draws.append(tuple(gen.tokens))
        drafted, accepted = drafted + sum(gen.drafted), accepted + sum(gen.accepted)
    return draws, (drafted, accepted)


def _test_depth(model, prompt: list[int], draws: list[tuple], depth: int, params) -> tuple:
    """The chi-square of token ``depth`` of ``draws`` against the target's law given the prompt
    and the tokens before it, pooled over those prefixes.

    Returns:
        ``(statistic, dof, groups tested, groups skipped)``.
    """
    groups = Counter(d[:depth] for d in draws if len(d) > depth)
    contexts = [c for c, n in groups.items() if n >= 2 * MIN_EXPECTED]
    skipped = len(groups) - len(contexts)
    if not contexts:
        return 0.0, 0, 0, skipped
    p = exact_probabilities(model, [list(prompt) + list(c) for c in contexts], params)
    statistic, dof, tested = 0.0, 0, 0
    for context, row in zip(contexts, p, strict=True):
        tokens = torch.tensor([d[depth] for d in draws if d[:depth] == context])
        observed = torch.bincount(tokens, minlength=row.shape[0]).double()
        cells = pearson(observed, len(tokens) * row)
        if cells is None:
            skipped += 1
            continue
        statistic, dof, tested = statistic + cells[0], dof + cells[1], tested + 1
    return statistic, dof, tested, skipped


@torch.inference_mode()
def exact_probabilities(
    model, contexts: Sequence[Sequence[int]], params: SamplingParams, batch: int = 64
) -> torch.Tensor:
    """``[N, V]`` float64: the target's processed next-token law after each context, from a
    plain forward of the model (no cache, no session) over batches of equal-length contexts."""
    device = next(model.parameters()).device
    rows = [None] * len(contexts)
    for length in sorted({len(c) for c in contexts}):
        same = [i for i, c in enumerate(contexts) if len(c) == length]
        for index in (same[j : j + batch] for j in range(0, len(same), batch)):
            ids = torch.tensor([list(contexts[i]) for i in index], device=device)
            logits = _last_logits(model, ids, 1)[:, 0]  # [n, V]
            for i, p in zip(index, probabilities(logits, params).double().cpu(), strict=True):
                rows[i] = p
    return torch.stack(rows)


@torch.inference_mode()
def pit_of_draws(model, prompt: list[int], draws: list[tuple], params, generator, batch: int = 8):
    """The randomised PIT (:func:`pit_values`) of every token of ``draws`` (all of one length)
    under the target's processed law after the prompt and the draw's tokens before it, from
    plain forwards of the model over ``batch`` draws at a time.

    Returns:
        ``(u, outside)``: ``[len(draws) * T]`` float64, and how many tokens had probability 0.
    """
    device = next(model.parameters()).device
    keep = len(draws[0]) + 1  # logits after the prompt's last token and after each drawn token
    pits, outside = [], 0
    for i in range(0, len(draws), batch):
        ids = torch.tensor([list(prompt) + list(d) for d in draws[i : i + batch]], device=device)
        logits = _last_logits(model, ids, keep)[:, :-1]  # [b, T, V]
        p = probabilities(logits.flatten(0, 1), params).double().cpu()
        tokens = ids[:, 1 - keep :].flatten().cpu()
        outside += int((p.gather(-1, tokens[:, None]) == 0).sum())
        pits.append(pit_values(p, tokens, generator))
    return torch.cat(pits), outside


def _last_logits(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n, V]``: the logits of a plain forward (no cache) at the last ``n`` positions."""
    keep = {"logits_to_keep": n} if "logits_to_keep" in signature(model.forward).parameters else {}
    return model(input_ids=ids, **keep).logits[:, -n:]


def pit_values(p: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The randomised probability integral transform of ``tokens`` ``[N]`` under the laws ``p``
    ``[N, V]``: U = (mass of the tokens ranked before x) + V p(x), ranking by probability,
    highest first, ties by token id; V ~ Uniform(0, 1) from ``generator``. ``[N]`` float64."""
    p = p / p.sum(-1, keepdim=True)
    px = p.gather(-1, tokens[:, None])  # [N, 1]
    ids = torch.arange(p.shape[-1])
    before = (p > px) | ((p == px) & (ids < tokens[:, None]))
    v = torch.rand(len(tokens), generator=generator, dtype=torch.float64)
    return (p * before).sum(-1) + v * px[:, 0]


def ks_uniform(u: torch.Tensor) -> float:
    """The Kolmogorov-Smirnov distance of the sample ``u`` from Uniform(0, 1)."""
    u, n = u.double().sort().values, len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for Kolmogorov's limit law of sqrt(n) D_n, D_n the Kolmogorov-Smirnov distance
    of n uniforms (conservative for finite n): 2 sum (-1)^(j-1) exp(-2 j^2 x^2), or for small x
    one minus the Jacobi theta form sqrt(2 pi) / x sum exp(-(2j - 1)^2 pi^2 / (8 x^2))."""
    if x <= 0:
        return 1.0
    if x < 1.0:
        cdf = sum(math.exp(-((2 * j - 1) ** 2) * math.pi**2 / (8 * x * x)) for j in range(1, 50))
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / x * cdf))
    tail = sum((-1) ** (j - 1) * math.exp(-2 * j * j * x * x) for j in range(1, 100))
    return min(1.0, max(0.0, 2 * tail))


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
