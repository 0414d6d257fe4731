"""The faces every drafter family offers: one for the decoder, one for the trainer.

Decoding face (:class:`Drafter`): ``begin`` on a prompt with the target's features over it,
``propose`` up to k tokens after the current sequence (with the exact distributions they were
drawn from, or none for a deterministic draft), and ``commit`` what the target accepted, with
the target's features of the kept positions, so the drafter's own state (KV cache, features)
stays in step. A drafter may work over a reduced vocabulary internally; the distributions it
returns are always over the target's vocabulary (zero outside its own), which keeps rejection
sampling exact.

Training face (:class:`TrainableDrafter`): the trainable module only (frozen parts borrowed
from the target are referenced, neither trained nor saved); ``module(input_ids,
attention_mask, features, at=None)`` returns S steps of draft logits ``[S, B, T, D]``
(with ``at``, ``[B, T]`` booleans, ``[S, N, D]`` at those N rows alone, in ``x[at]``'s order:
a family skips what only the others need), and ``teacher(target_logits, loss_mask)`` the
matching step-shifted targets and masks. Step s at row t predicts token ``t + 1 + shift + s``: a
draft model (S = 1, shift 0) predicts the next token; EAGLE-3 (shift 1) reads the target's
features at t and the token t + 1, and unrolls S steps on its own outputs. The trainer asks
the target for ``required_target_layers`` and knows no family.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.decoding import kernels
from specdec.decoding.sampling import SamplingParams, probabilities, sample
from specdec.sparse_teacher import SparseTeacher

#: how a drafter's own forward runs while decoding: auto (on a CPU, where a draft step is bound
#: by reading the weights, float16 or its own dtype, whichever is measured faster there; its
#: own dtype elsewhere), a dtype (a converted copy of the weights), or transformers (its own
#: weights as they are)
FORWARDS = ("auto", "transformers", "float32", "float16", "bfloat16")


def checked_forward(forward: str) -> str:
    """``forward`` if it is one of :data:`FORWARDS`.

    Raises:
        ConfigError: it is not.
    """
    if forward not in FORWARDS:
        from specdec.errors import ConfigError

        raise ConfigError(f"draft forward {forward!r}: expected one of {', '.join(FORWARDS)}")
    return forward


def decoding_dtype(
    forward: str, module: torch.nn.Module, kernels_used: Sequence[str] | None = None
) -> torch.dtype:
    """The dtype the drafter network ``module`` decodes in under ``forward``; ``auto``
    measures which is faster on a CPU through ``kernels_used`` (default: the fastest of them,
    as :func:`kernels.tuned_linear` picks)."""
    if forward in ("float32", "float16", "bfloat16"):
        return getattr(torch, forward)
    weight = next(module.parameters())
    if forward == "auto" and weight.device.type == "cpu" and weight.dtype != torch.float16:
        return kernels.fastest_dtype(module, (torch.float16, weight.dtype), kernels_used)
    return weight.dtype


class DecodingCopy:
    """The module a drafter decodes with: the trained one, or a copy of it in the decoding
    dtype (``module.converted(dtype)``), made again when an optimizer step has changed the
    trained weights since. Decoding stays exact in any dtype: the distributions a drafter
    reports are the ones it sampled from."""

    def __init__(self):
        self.copy, self.version = None, None

    def get(self, module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        weight = next(module.parameters())
        if dtype == weight.dtype:
            self.copy, self.version = None, None  # (a copy made earlier is not kept alive)
            return module
        version = (dtype, weight.device, sum(p._version for p in module.parameters()))
        if self.version != version:
            with torch.random.fork_rng(devices=[]):  # the copy's own initial values, drawn
                self.copy = module.converted(dtype)  # and overwritten, leave training's RNG
            self.version = version
        return self.copy


@dataclass
class Proposal:
    """Drafted tokens: a chain, or a tree.

    Attributes:
        tokens: ``[n]`` token ids, n <= k (n may be 0: nothing worth proposing).
        probs: ``[n, V]`` the distributions the tokens were drawn from (target vocabulary),
            or None when the draft is deterministic (greedy drafting, n-gram lookup).
        parents: None for a chain (token i follows token i - 1); for a tree, ``[n]`` the index
            of each node's parent (-1: the last verified token).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter:
    """Base class of the decoding face. Subclasses implement ``propose``."""

    name: str = "drafter"
    #: decoder-layer indices of the target whose outputs the drafter consumes
    required_target_layers: tuple[int, ...] = ()
    #: how the drafter's own forward runs while decoding (None: it has none)
    forward: str | None = None
    #: stop drafting once the draft's own probability of its chain falls below this (0: never)
    confidence: float | None = None
    #: the family can draft trees (:mod:`specdec.drafters.tree`)
    branches: bool = False
    #: the tree it drafts (a ``TreeSpec``), None: chains
    tree = None
    #: its proposals are verified by a model of its own (:meth:`verifier`), not the target
    adapts_target: bool = False
    #: the serving layouts it exports (format -> weights file; :meth:`export_layout`)
    layouts: dict[str, str] = {}

    def configure(self, forward: str = "auto", confidence: float = 0.0, tree=None) -> None:
        """Apply the decoding knobs (``eval.draft_forward``, ``eval.draft_confidence``, the
        tree) that the family has; families without a forward or a confidence stop ignore
        them; a tree for a family that cannot branch is an error.

        Raises:
            ConfigError: a tree asked of a family that drafts chains only.
        """
        if tree is not None and not self.branches:
            from specdec.errors import ConfigError

            raise ConfigError(f"eval.tree: a '{self.name}' drafter drafts chains only")

    def begin(self, prompt: Sequence[int], target_features: dict | None = None) -> None:
        """Start a new sequence. ``target_features`` holds the requested target layers'
        outputs over the prompt (``{layer: [T, H]}``)."""

    def propose(
        self,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Propose up to ``k`` tokens to follow ``sequence`` (prompt and output so far)."""
        raise NotImplementedError

    def commit(self, num_accepted: int, target_features: dict | None = None) -> None:
        """The target accepted ``num_accepted`` tokens of the last proposal and added one of
        its own. ``target_features`` covers the positions newly in the target's cache: the
        token before the proposal and the accepted ones (``{layer: [n + 1, H]}``).

        Every round is committed, also one in which this drafter proposed nothing (no budget
        left) or another drafter's proposal was verified (a
        :class:`~specdec.drafters.hybrid.HybridDrafter`'s prompt lookup rounds): a drafter
        advances its state with these features and the next ``propose``'s sequence, never by
        assuming that its own last draft was the one verified."""

    @property
    def draft_seconds(self) -> float:
        """Seconds this drafter spent in model forwards (0 for model-free drafters)."""
        return 0.0

    def verifier(self, model):
        """The model that verifies this drafter's proposals, given the target's: the target
        itself, except for drafters trained with an adapted target (``adapts_target``), whose
        output is that adapted model's."""
        return model

    def transformers_model(self, where: str = ""):
        """The drafter as a standalone transformers causal LM over the target's vocabulary,
        for formats that load one (``generate(assistant_model=...)``).

        Raises:
            ModelError: the drafter is not one.
        """
        from specdec.errors import ModelError

        raise ModelError(
            f"{where or self.name}: a '{self.name}' drafter is not a standalone causal LM over "
            "the target's vocabulary"
        )

    def export_layout(self, fmt: str, target) -> tuple[dict, dict]:
        """``(config.json, weights)`` of the drafter in a serving engine's layout ``fmt``, one
        of its ``layouts`` (the exporter checks that first).

        Raises:
            ModelError: the family has no such layout.
        """
        from specdec.errors import ModelError

        raise ModelError(f"a '{self.name}' drafter has no '{fmt}' layout")

    @staticmethod
    def layout_keys(fmt: str, config: dict) -> set[str]:
        """The weights a layout's loader reads, from its ``config.json``."""
        return set()

    def export_extras(self, fmt: str, target, directory: Path, final: Path) -> dict:
        """Write (and verify) files a layout needs beside its weights into ``directory``,
        which becomes ``final``; returns entries for its ``config.json``. Default: none."""
        return {}


class Teacher:
    """The targets of S draft steps: step s at row t learns the target's distribution at row
    ``t + shift + s``, where ``mask[s]`` (``[S, B, T]`` booleans) sets (b, t).

    It holds the target's log-probabilities only at the rows some step reads, once; each step
    gathers its own rows (:meth:`at`), so no shifted ``[S, B, T, D]`` copy is ever made.

    Args:
        log_p: ``[R, D]`` the target's log-probabilities over the full vocabulary, read at the
            teacher's D tokens (their sum is below 1 where the target puts mass outside them;
            a loss renormalises them, acceptance metrics do not); a :class:`SparseTeacher` of
            them from a top-k cache.
        best: ``[R]`` the target's full-vocabulary argmax as an index into those D tokens,
            -1 outside them (a position no draft can get right).
        row_of: ``[B, T]`` the row of ``log_p`` holding position (b, t), -1 where none does
            (no step reads it).
        mask: ``[S, B, T]`` where step s at row t is trained on.
        shift: step 0 at row t reads the target's row ``t + shift``.
        vocabs: per step, the target ids to narrow the D tokens to (None: keep them all).
    """

    def __init__(self, log_p, best, row_of, mask, shift: int, vocabs: list):
        self.log_p, self.best, self.row_of = log_p, best, row_of
        self.mask, self.shift, self.vocabs = mask, shift, vocabs

    def at(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``s``'s targets at the N positions ``mask[s]`` sets, in ``x[mask[s]]``'s order:
        ``[N, D_s]`` log-probabilities and ``[N]`` argmax as a draft index (-1 outside)."""
        log_p, best, _ = self.over(s, self.mask[s])
        return log_p, best

    def over(self, s: int, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``s``'s targets at the N positions of ``at`` (``[B, T]``, a superset of
        ``mask[s]``), in ``x[at]``'s order, as :meth:`at` gives them, and ``[N]`` whether step
        ``s`` trains each. An untrained position holds the targets of a trained one (finite
        values for a loss to mask) and the argmax -1 (never a hit)."""
        b, t = at.nonzero(as_tuple=True)
        trained = self.mask[s][b, t]
        ahead = (t + self.shift + s).clamp(max=at.shape[1] - 1)
        rows = torch.where(trained, self.row_of[b, ahead], 0)  # row 0 exists when N > 0
        log_p, best = _restrict(self.log_p[rows], self.best[rows], self.vocabs[s])
        return log_p, torch.where(trained, best, -1), trained


class TrainableDrafter(Drafter):
    """A drafter with a training face. Families set ``steps`` and ``shift`` and provide
    ``module``, ``draft_ids``, ``save``, ``build`` and ``from_checkpoint``."""

    #: draft steps per training position (S)
    steps: int = 1
    #: step 0 at row t predicts token t + 1 + shift
    shift: int = 0
    #: ``[D]`` target ids of the draft's outputs (None: the full target vocabulary)
    draft_ids: torch.Tensor | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The trainable module: ``module(input_ids, attention_mask, features, at=None)``
        returns ``[S, B, T, D]`` logits (``[S, N, D]`` at the N rows ``at`` sets, when given,
        in ``x[at]``'s order)."""
        raise NotImplementedError

    @property
    def layout_module(self) -> torch.nn.Module:
        """The module a serving layout holds, compared with its reload by an export (the
        trainable module, unless it carries more than the layout: Medusa-2's adapters)."""
        return self.module

    def prepare_training(self, config, target) -> None:
        """Apply the recipe's training-only options (its ``drafter`` section) for ``target``,
        whether the drafter was built fresh or loaded from ``from_pretrained``; most families
        have none."""

    def loaded_shape(self, config, target) -> dict[str, tuple]:
        """For a drafter loaded through ``from_pretrained``: each ``drafter`` key that fixes its
        weights' shape, as ``{key: (the recipe's value, the loaded drafter's)}``; the recipe is
        refused where they differ. Empty for families whose recipe sets no shape."""
        return {}

    def param_groups(self, params: list, lr: float) -> list[dict]:
        """The optimizer's parameter groups over the trainable ``params`` (the recipe's
        ``train.lr`` is ``lr``): one group, unless a family trains parts at other rates."""
        return [{"params": params}]

    def step_weights(self) -> torch.Tensor:
        """``[S]`` loss weight of each step."""
        return torch.ones(self.steps)

    def loss_masks(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """``[S, B, T]``: step s at row t counts where token ``t + 1 + shift + s`` is an
        assistant token of the ``[B, T]`` ``loss_mask``."""
        return torch.stack([_shift_left(loss_mask, 1 + self.shift + s) for s in range(self.steps)])

    def step_vocab(self, step: int) -> torch.Tensor | None:
        """``[D]`` target ids of step ``step``'s outputs (None: the full vocabulary); the same
        for every step unless a family's steps differ (Medusa-2: the backbone's own step)."""
        return self.draft_ids

    @property
    def teacher_vocab(self) -> torch.Tensor | None:
        """The target ids the teacher's log-probabilities are taken over, from the target or a
        cache: the steps' vocabulary, or the full one where the steps' differ."""
        vocabs = [self.step_vocab(s) for s in range(self.steps)]
        return vocabs[0] if all(v is vocabs[0] for v in vocabs) else None

    def teacher(
        self, target_logits: torch.Tensor, loss_mask: torch.Tensor, at: torch.Tensor | None = None
    ) -> Teacher:
        """The target's distributions for each step: row ``t + shift + s`` of the target's
        logits predicts the token that step s at row t predicts.

        Args:
            target_logits: ``[B, T, V]`` the target's logits, or ``[N, V]`` at the rows ``at``.
            loss_mask: ``[B, T]`` the assistant tokens.
            at: ``[B, T]`` booleans, the rows ``target_logits`` holds (every row a step
                reads), in ``x[at]``'s order; None: every row.
        """
        log_p = torch.log_softmax(target_logits.float(), dim=-1)
        log_p, best = _restrict(log_p, log_p.argmax(dim=-1), self.teacher_vocab)
        return self.shifted_teacher(log_p, best, loss_mask, at)

    def shifted_teacher(
        self,
        log_p: torch.Tensor,
        best: torch.Tensor,
        loss_mask: torch.Tensor,
        at: torch.Tensor | None = None,
    ) -> Teacher:
        """:meth:`teacher` from the target's log-probabilities over :attr:`teacher_vocab` and
        its top token there (-1: outside it), e.g. from a cache: ``[B, T, D]`` and ``[B, T]``,
        or ``[N, D]`` and ``[N]`` at the rows ``at`` sets."""
        B, T = loss_mask.shape
        if at is None:
            row_of = torch.arange(B * T, device=log_p.device).view(B, T)
            log_p, best = log_p.flatten(0, 1), best.flatten(0, 1)
        else:
            row_of = torch.full((B, T), -1, dtype=torch.long, device=log_p.device)
            row_of[at] = torch.arange(len(log_p), device=log_p.device)
        given = self.teacher_vocab
        vocabs = [None if v is given else v for v in map(self.step_vocab, range(self.steps))]
        mask = self.loss_masks(loss_mask).bool()
        return Teacher(log_p, best, row_of, mask, self.shift, vocabs)

    def save(self, path: str | os.PathLike, *, target_name: str, extra: dict | None = None) -> Path:
        """Write a checkpoint directory atomically; it describes itself (``drafter.json``)."""
        raise NotImplementedError


def vocab_shape(config, draft_ids: torch.Tensor | None, target) -> tuple[int, int]:
    """``drafter.draft_vocab_size`` for :meth:`TrainableDrafter.loaded_shape`: the recipe's
    and the loaded drafter's output vocabulary sizes (the full one where either is null)."""
    wanted = min(config.draft_vocab_size or target.vocab_size, target.vocab_size)
    return wanted, target.vocab_size if draft_ids is None else len(draft_ids)


def draft_chain(
    logits: torch.Tensor,
    advance,
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_ids: torch.Tensor | None,
    vocab_size: int,
    confidence: float = 0.0,
) -> Proposal:
    """Draft up to ``k`` tokens one after another, as every autoregressive drafter does.

    Args:
        logits: ``[D]`` the drafter's logits for the first draft token.
        advance: ``advance(token, i)`` feeds draft token i to the drafter and returns its
            ``[D]`` logits for the next one.
        k: the most tokens to draft.
        params: greedy (argmax, no q) or sampling (q = the processed distribution drawn from).
        generator: randomness for sampling.
        draft_ids: ``[D]`` target ids of the drafter's outputs (None: the target's vocabulary).
        vocab_size: the target's vocabulary size (width of the returned q).
        confidence: stop once the product of the drafted tokens' own probabilities falls
            below this (the first token is always drafted; it depends only on the draft's
            distributions, so decoding stays exact); 0 drafts all k.
    """
    from specdec.drafters.vocabulary import to_target

    tokens, dists, chain = [], [], 1.0
    for i in range(k):
        logits = logits.float()
        if params.greedy:
            choice = logits.argmax(dim=-1)
        else:
            q = probabilities(logits, params)
            choice = sample(q, generator)
            dists.append(q)
        token = choice if draft_ids is None else draft_ids[choice]
        tokens.append(token)
        if confidence > 0:
            chain *= float(torch.softmax(logits, -1)[choice] if params.greedy else q[choice])
            if chain < confidence:
                break
        if i + 1 < k:
            logits = advance(token, i)
    q = to_target(torch.stack(dists), draft_ids, vocab_size) if dists else None
    return Proposal(torch.stack(tokens), q)


def _restrict(log_p: torch.Tensor, best: torch.Tensor, ids: torch.Tensor | None):
    """``(log_p, best)`` over the full vocabulary read at the target ids ``ids`` (None: all),
    the argmax becoming an index into them (-1: outside them)."""
    if ids is None:
        return log_p, best
    if isinstance(log_p, SparseTeacher):
        log_p = log_p.dense()
    ids = ids.to(log_p.device)
    index = torch.full((log_p.shape[-1],), -1, dtype=torch.long, device=ids.device)
    index[ids] = torch.arange(len(ids), device=ids.device)
    return log_p.index_select(-1, ids), index[best]


def _shift_left(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[B, T]`` ``mask`` moved left by ``n`` (row t holds row t + n), padded with 0."""
    out = torch.zeros_like(mask)
    out[:, : max(mask.shape[1] - n, 0)] = mask[:, n:]
    return out
