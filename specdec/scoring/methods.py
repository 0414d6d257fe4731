"""The methods ``specdec eval`` compares, named on its command line, and how each decodes.

A method is specdec's decoder with a drafter, or transformers' own ``generate``:

- ``plain``: specdec's decoder without a drafter (the baseline of every speedup);
- ``generate``: transformers' ``generate()`` without a drafter (its baseline);
- a training-free family by name (``prompt_lookup``);
- ``PATH`` or ``checkpoint:PATH``: a trained specdec checkpoint;
- ``draft_model:PATH``: any transformers causal LM sharing the target's tokenizer, drafting
  through specdec's decoder;
- ``prompt_lookup+PATH`` / ``prompt_lookup+draft_model:PATH``: prompt lookup where the context
  holds a match, the other drafter elsewhere;
- ``hf_assisted:PATH``: transformers' assisted generation with that draft model;
- ``hf_prompt_lookup``: transformers' prompt lookup decoding;
- ``SPEC@dynamic`` / ``SPEC@static``: a drafter of the above that branches, verifying a tree
  each round (a dynamic tree sized by ``--tree-budget`` or the measured verify cost; a static
  one calibrated on the warm-up prompts from the dynamic tree's accepted paths).
- ``SPEC@confidence=C``: a drafter of the above stopping its chain (or a tree's growth) once
  its probability falls below ``C``, whatever ``--draft-confidence`` says, so drafters tuned to
  different stops run side by side (``best@static@confidence=0.3``).
- ``SPEC@min_ngram=N``: prompt lookup (alone or in a hybrid) trusting only matches of at least
  ``N`` tokens; in a hybrid the other drafter drafts where prompt lookup finds none.
- ``SPEC@copy_start=N``: prompt lookup (alone or in a hybrid) copying ``N`` tokens at first,
  twice as many after each copy accepted whole (0: always k).

Specs are parsed (:func:`parse`) before any model loads, so a method that does not exist, a
missing path or a checkpoint of another target fails in one line first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec import drafters
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.speculative import Generation
from specdec.drafters.checkpoint import CHECKPOINT_FILE
from specdec.errors import ConfigError, ModelError

PLAIN, GENERATE = "plain", "generate"
CHECKPOINT, HF_ASSISTED, HF_PROMPT_LOOKUP = "checkpoint:", "hf_assisted:", "hf_prompt_lookup"
TREES = ("dynamic", "static")  # the ``@TREE`` suffixes
CONFIDENCE = "confidence="  # the ``@confidence=C`` suffix
#: prompt lookup's settings an ``@NAME=N`` suffix sets (alone or in a hybrid): NAME -> least N
LOOKUP_SETTINGS = {"min_ngram": 1, "copy_start": 0}
DRAFT_MODEL, HYBRID = drafters.MODEL_PREFIX, drafters.HYBRID_PREFIX


@dataclass
class Method:
    """One method of an evaluation.

    Attributes:
        name: the spec as given (the key of its results).
        kind: ``plain``, ``drafter`` (specdec's decoder with a drafter) or ``transformers``.
        source: what to load: a checkpoint directory, a model path or id, a family name.
        load: ``checkpoint``, ``model`` or ``family`` (for ``drafter``); for ``transformers``,
            ``assisted``, ``lookup`` or ``plain``.
        hybrid: prompt lookup in front of the drafter.
        drafter: the loaded drafter (``drafter`` kind).
        assistant: the loaded draft model (``hf_assisted``).
        tree: ``chain``, or the tree its drafter verifies (``dynamic``, ``static``).
        confidence: its own draft confidence stop (``@confidence=C``); None: the run's.
        min_ngram: prompt lookup's shortest trusted match (``@min_ngram=N``); None: its
            default (1 alone, :data:`specdec.drafters.HYBRID_MIN_NGRAM` in a hybrid).
        copy_start: prompt lookup's first copy length (``@copy_start=N``); None: its default.
    """

    name: str
    kind: str
    source: str | None = None
    load: str | None = None
    hybrid: bool = False
    drafter: object = None
    assistant: object = None
    meta: dict = field(default_factory=dict)
    tree: str = "chain"
    confidence: float | None = None
    min_ngram: int | None = None
    copy_start: int | None = None

    @property
    def speculative(self) -> bool:
        """Whether the method drafts (it has an acceptance to report)."""
        return self.kind == "drafter" or self.load in ("assisted", "lookup")


def parse(spec: str) -> Method:
    """The method a command-line spec names, checked without loading any model.

    Raises:
        ConfigError: an unknown name, an empty path, or a path that does not exist.
    """
    spec = spec.strip()
    base, suffixes = spec, []
    while (cut := base.rpartition("@"))[1] and (
        cut[2] in TREES or cut[2].startswith((CONFIDENCE, *(f"{n}=" for n in LOOKUP_SETTINGS)))
    ):
        base, suffixes = cut[0], [cut[2], *suffixes]
    if not suffixes:
        return _parse_base(spec)
    method = _parse_base(base)
    trees = [s for s in suffixes if s in TREES]
    stops = [s for s in suffixes if s.startswith(CONFIDENCE)]
    lookups = {n: [s for s in suffixes if s.startswith(f"{n}=")] for n in LOOKUP_SETTINGS}
    for kind, given in [("tree", trees), ("confidence", stops), *lookups.items()]:
        if len(given) > 1:
            raise ConfigError(f"method '{spec}': one {kind} suffix at most")
    if method.kind != "drafter":
        does = (
            "verifies trees" if trees
            else "takes a draft confidence" if stops
            else "takes a prompt lookup setting"
        )  # fmt: skip
        raise ConfigError(
            f"method '{spec}': only a drafter of specdec's decoder {does}, not '{base}'"
        )
    method.name = spec
    if trees:
        method.tree = trees[0]
    if stops:
        method.confidence = _confidence(spec, stops[0])
    for setting, given in lookups.items():
        if not given:
            continue
        own = method.load == "family" and drafters.has_option(method.source, setting)
        if not (method.hybrid or own):
            raise ConfigError(
                f"method '{spec}': @{setting}=N sets prompt lookup's, alone or in front of a "
                f"drafter ({HYBRID}PATH); '{base}' has none"
            )
        setattr(method, setting, _lookup_setting(spec, given[0], setting))
    return method


def _lookup_setting(spec: str, suffix: str, setting: str) -> int:
    text, least = suffix.removeprefix(f"{setting}="), LOOKUP_SETTINGS[setting]
    if not text.isdigit() or int(text) < least:
        raise ConfigError(f"method '{spec}': {suffix}: expected an integer >= {least}")
    return int(text)


def _confidence(spec: str, suffix: str) -> float:
    text = suffix.removeprefix(CONFIDENCE)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:  # NaN fails too
        raise ConfigError(f"method '{spec}': {suffix}: expected a number in [0, 1)")
    return value


def _parse_base(spec: str) -> Method:
    """A method spec without ``@`` suffixes."""
    if spec == PLAIN:
        return Method(spec, "plain")
    if spec == GENERATE:
        return Method(spec, "transformers", load="plain")
    if spec == HF_PROMPT_LOOKUP:
        return Method(spec, "transformers", load="lookup")
    if spec.startswith(HF_ASSISTED):
        return Method(spec, "transformers", _model_path(spec, HF_ASSISTED), load="assisted")
    inner, hybrid = spec, spec.startswith(HYBRID)
    if hybrid:
        inner = spec[len(HYBRID) :]
        if not inner:
            raise ConfigError(f"method '{spec}': name the drafter after '+'")
    if inner.startswith(DRAFT_MODEL):
        return Method(spec, "drafter", _model_path(inner, DRAFT_MODEL), "model", hybrid)
    if not hybrid and inner in drafters.training_free():
        return Method(spec, "drafter", inner, "family")
    path = inner.removeprefix(CHECKPOINT)
    if Path(path).is_dir() and (Path(path) / CHECKPOINT_FILE).is_file():
        meta = drafters.read_meta(path)
        return Method(spec, "drafter", path, "checkpoint", hybrid, meta=meta)
    if inner.startswith(CHECKPOINT) or Path(path).exists():
        raise ConfigError(f"method '{spec}': {path} is not a specdec checkpoint directory")
    raise ConfigError(
        f"method '{spec}': unknown; expected {PLAIN}, {GENERATE}, "
        f"{', '.join(drafters.training_free())}, a checkpoint directory, {DRAFT_MODEL}PATH, "
        f"{HYBRID}PATH, {HF_ASSISTED}PATH or {HF_PROMPT_LOOKUP}"
    )


def _model_path(spec: str, prefix: str) -> str:
    """The model after ``prefix``: a local path must exist; anything else is a hub id."""
    source = spec[len(prefix) :]
    if not source:
        raise ConfigError(f"method '{spec}': give a model path or id after '{prefix}'")
    looks_local = source.startswith(("/", ".", "~")) or Path(source).expanduser().exists()
    if looks_local and not Path(source).expanduser().exists():
        raise ConfigError(f"method '{spec}': {source} does not exist")
    return str(Path(source).expanduser()) if looks_local else source


def check_targets(methods: list[Method], target_spec: str) -> None:
    """Every checkpoint was trained for the target evaluated.

    Raises:
        ConfigError: a checkpoint records another target.
    """
    for m in methods:
        trained_for = m.meta.get("target")
        if trained_for and trained_for != target_spec:
            raise ConfigError(
                f"method '{m.name}': a checkpoint for target '{trained_for}', evaluated "
                f"against '{target_spec}'; pass --target {trained_for} or another checkpoint"
            )


def load(method: Method, target, max_ngram: int | None = None) -> None:
    """Load what the method needs, against ``target`` (a ``FrozenTarget``)."""
    if method.kind == "drafter":
        # prompt lookup's settings, alone or in front of the drafter (None: its defaults)
        lookup = {"max_ngram": max_ngram, **{n: getattr(method, n) for n in LOOKUP_SETTINGS}}
        if method.load == "checkpoint":
            drafter = drafters.load(method.source, target)
        elif method.load == "model":
            drafter = drafters.from_model(method.source, target)
        else:
            drafter = drafters.build(target, drafters.config_for(method.source, **lookup))
        if method.hybrid:
            drafter = drafters.hybrid(drafter, **lookup)
        method.drafter = drafter
        if method.tree != "chain" and not method.drafter.branches:
            raise ConfigError(
                f"method '{method.name}': a '{method.drafter.name}' drafter drafts chains "
                f"only; drop '@{method.tree}'"
            )
    elif method.load == "assisted":
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(method.source, dtype=target.model.dtype)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"method '{method.name}': cannot load {method.source}: {err}"
            ) from None
        method.assistant = model.to(target.device).eval()


def run_transformers(
    method: Method,
    model,
    ids: list[int],
    *,
    k: int,
    max_new_tokens: int,
    params: SamplingParams,
    eos: list[int],
    seed: int,
) -> Generation:
    """Decode with transformers' ``generate`` (plain, assisted or prompt lookup), timed."""
    extra: dict = {}
    if method.load == "assisted":
        extra = {
            "assistant_model": method.assistant,
            "num_assistant_tokens": k,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,  # always k, as specdec's chain drafts
        }
    elif method.load == "lookup":
        extra = {"prompt_lookup_num_tokens": k}
    sampling = {"do_sample": False}
    if not params.greedy:
        sampling = {
            "do_sample": True,
            "temperature": params.temperature,
            "top_k": params.top_k or None,
            "top_p": params.top_p,
        }
    x = torch.tensor([ids], device=model.device)
    torch.manual_seed(seed)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    try:
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **sampling,
            **extra,
        )
    except (ValueError, TypeError, NotImplementedError) as err:
        raise ModelError(f"method '{method.name}': transformers refused: {err}") from None
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    tokens = out[0, len(ids) :].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    gen = Generation(tokens=tokens if stop is None else tokens[: stop + 1])
    gen.prefill_seconds = time.perf_counter() - t0  # the whole call: no rounds to split
    gen.finished = stop is not None
    return gen
