"""The recipe schema: one dataclass per YAML section, each field with its help text and rules.

The dataclasses are the single description of a recipe: :mod:`specdec.config.validation` checks
raw YAML against them and :func:`~specdec.config.loader.describe` prints them. Field rules
(``ge``, ``gt``, ``le``, ``choices``) live in the field metadata, set by :func:`_opt`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

LossName = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "ce"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
TRACKERS = ("wandb", "tensorboard")
DEFAULT_TARGET = "smollm2-135m-instruct"
ACCELERATE_DIR = "accelerate"


def export_formats() -> tuple[str, ...]:
    """The formats ``specdec export`` writes (the exporters' registry, which drafter families
    extend with layouts of their own)."""
    from specdec.export import EXPORTERS

    return tuple(EXPORTERS)


def _opt(default: Any = MISSING, help: str = "", **rules: Any) -> Any:
    """A dataclass field with help text and optional ``rules`` checked on load.

    Rules: ``ge``, ``gt``, ``le``, ``lt`` bound a number; ``choices`` lists the allowed strings
    (for a list, each item; for a dict, each key), or a function returning them (a registry read
    when a recipe is checked). Mutable defaults become factories.
    """
    metadata = {"help": help, **rules}
    if isinstance(default, list | dict) or dataclasses.is_dataclass(default):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunConfig:
    name: str = _opt("run", "Run name; the run directory is runs/<name> unless output_dir is set.")
    output_dir: str | None = _opt(None, "Run directory (checkpoints, metrics); null: runs/<name>.")
    seed: int = _opt(0, "Seed for model initialisation, data order and sampling.")
    log_level: Literal["debug", "info", "warning"] = _opt("info", "Logging verbosity.")


@dataclass
class TargetConfig:
    model: str = _opt(
        DEFAULT_TARGET,
        f"Frozen target: '{DEFAULT_TARGET}' (the embedded default), a hub id, a local "
        "directory, or a path to a .gguf file.",
    )
    gguf_file: str | None = _opt(None, "GGUF file name inside a hub repo or local directory.")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of the target.")
    dtype: Literal["float32", "bfloat16", "float16"] = _opt("float32", "Target weight dtype.")
    device: str = _opt("auto", "Device of the target: auto, cpu, cuda, cuda:1, mps ...")
    cache_dir: str | None = _opt(
        None, "Model/data cache; null: $SPECDEC_CACHE or ~/.cache/specdec."
    )
    attn_implementation: str | None = _opt(None, "transformers attention backend, e.g. sdpa.")
    trust_remote_code: bool = _opt(False, "Allow custom modeling code from the hub repo.")


@dataclass
class DrafterConfig:
    """What every drafter family's section has. Each family subclasses it with its own fields
    (in its module under ``specdec/drafters/``); ``drafter.type`` picks the subclass."""

    type: str = _opt(help="Drafter family (registry name).")
    from_pretrained: str | None = _opt(None, "Start from a saved drafter checkpoint directory.")

    def check(self) -> None:
        """Rules between the family's fields; raises ``Invalid`` naming the key."""

    @staticmethod
    def variants() -> dict[str, type]:
        """Family name -> its config dataclass, from the drafter registry."""
        from specdec.drafters import config_classes

        return config_classes()

    @staticmethod
    def default_variant() -> str:
        """The family of a section that names none."""
        from specdec.drafters import DEFAULT_FAMILY

        return DEFAULT_FAMILY


def default_drafter() -> DrafterConfig:
    """The default family's section with its defaults."""
    return DrafterConfig.variants()[DrafterConfig.default_variant()]()


#: the public name of the field helper, for the families' config dataclasses
option = _opt


@dataclass
class PromptSource:
    _shorthand = "source"  # a bare string in YAML means {source: <string>}

    source: str = _opt(
        help="A packaged name (alpaca_eval, arena_hard, ifeval, writingbench_en, healthbench, "
        "mtbench, humaneval, python_functions, python_methods), a local .jsonl/.json/.parquet "
        "file, or a hub dataset id."
    )
    format: Literal["auto", "openai", "sharegpt", "prompt", "mtbench"] = _opt(
        "auto",
        "Row shape: openai ('messages'), sharegpt ('conversations'), prompt (+ response), "
        "mtbench ('turns'); auto detects it from the row's keys.",
    )
    split: str = _opt("train", "Split of a hub dataset.")
    offset: int = _opt(0, "Skip this many rows first (disjoint slices of one source).", ge=0)
    limit: int | None = _opt(None, "Use at most this many rows of this source.", ge=1)
    category: str | None = _opt(None, "Keep only rows of this category.")
    responses: Literal["regenerate", "keep"] = _opt(
        "regenerate",
        "regenerate: the target answers this source's prompts again (self-distillation); "
        "keep: train on the rows' own assistant turns (no generation: much cheaper, the "
        "drafter still learns the target's distribution from its logits on that text).",
    )


@dataclass
class RegenerateConfig:
    enabled: bool = _opt(True, "Replace reference answers with the target's own completions.")
    max_new_tokens: int = _opt(256, "Length of each regenerated answer.", ge=1)
    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.", ge=0)
    top_p: float = _opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    top_k: int = _opt(0, "Top-k sampling; 0 is off.", ge=0)
    batch_size: int = _opt(16, "Prompts generated together.", ge=1)
    seed: int = _opt(0, "Sampling seed.")
    shard_size: int = _opt(64, "Rows per saved shard; an interrupted run resumes per shard.", ge=1)
    workers: int = _opt(
        1, "Processes generating at once, each loading the target and taking a share of the "
        "prompts and of the CPU threads.", ge=1,
    )  # fmt: skip
    backend: Literal["transformers", "compact", "vllm"] = _opt(
        "transformers", "transformers: the target's generate; compact: the compact forward "
        "with continuous batching of batch_size prompts (Llama, Qwen2, Qwen3; the fastest on a "
        "CPU); vllm: vLLM's engine (when it is installed; one process, it batches by itself).",
    )  # fmt: skip


@dataclass
class OnPolicyConfig:
    fraction: float = _opt(
        0.0, "Share of micro-batches drawn from the drafter's own continuations of training "
        "prompts, with the target's logits on them as the teacher (DistillSpec's on-policy "
        "data); 0 is off.", ge=0, le=1,
    )  # fmt: skip
    refresh_every: int = _opt(
        50, "Optimizer steps between rollouts; the first comes after this many steps on the "
        "fixed data.", ge=1,
    )  # fmt: skip
    prompts: int = _opt(64, "Training prompts the drafter continues at each refresh.", ge=1)
    max_new_tokens: int = _opt(128, "Length of each continuation.", ge=1)
    temperature: float = _opt(
        1.0, "Sampling temperature of the drafter's continuations; 0 is its greedy text.", ge=0
    )
    k: int = _opt(4, "Tokens drafted per target forward while rolling out.", ge=1)


@dataclass
class CacheConfig:
    dir: str | None = _opt(None, "Where the teacher cache lives; null: <run dir>/teacher-cache.")
    top_k: int = _opt(
        256, "Target log-probabilities kept per position: the top k with the log of the "
        "remaining mass; 0 keeps the full vocabulary.", ge=0,
    )  # fmt: skip
    dtype: Literal["float32", "float16", "bfloat16", "fp8"] = _opt(
        "float16", "Storage of hidden states and log-probabilities; fp8 is e4m3 with a scale "
        "per token (and layer); float32 is exact.",
    )  # fmt: skip
    batch_size: int = _opt(8, "Rows per target forward while caching.", ge=1)
    shard_rows: int = _opt(64, "Rows per shard; an interrupted cache resumes per shard.", ge=1)


@dataclass
class DataConfig:
    prompts: list[PromptSource] = _opt(
        [PromptSource(s) for s in ("alpaca_eval", "arena_hard", "ifeval", "writingbench_en")],
        "Training prompt sources, concatenated in order.",
    )
    max_prompts: int | None = _opt(None, "Use at most this many prompts in all.", ge=1)
    max_length: int = _opt(1024, "Longest tokenized conversation.", ge=2)
    overflow: Literal["truncate", "drop"] = _opt("truncate", "What to do with longer ones.")
    require_assistant: bool = _opt(False, "Error on a chat row without an assistant turn.")
    loss_on: Literal["assistant", "all"] = _opt(
        "assistant", "Positions that teach the drafter: the assistant's tokens, or every token "
        "of the training rows (the prompts too: more positions from the same target pass). "
        "Held-out rows are measured on assistant tokens either way.",
    )  # fmt: skip
    regenerate: RegenerateConfig = _opt(RegenerateConfig(), "Target regeneration of answers.")
    dataset_dir: str | None = _opt(None, "Where regenerated data lives; null: <run dir>/data.")
    num_proc: int = _opt(1, "Processes used for tokenization.", ge=1)
    heldout_rows: int = _opt(
        32, "Target-written training rows kept out of training; the drafter is evaluated on "
        "them every log interval (heldout/acc@i: the decoder's acceptance at T=0 on text like "
        "the target's). At most a quarter of the target-written rows; 0 turns it off.", ge=0,
    )  # fmt: skip
    teacher: Literal["online", "cache"] = _opt(
        "online", "online: the target runs on every training batch; cache: training reads "
        "the target's logits and hidden states from data.cache (built by `specdec data "
        "cache`, or by the first training run).",
    )  # fmt: skip
    cache: CacheConfig = _opt(CacheConfig(), "The teacher cache (data.teacher: cache).")
    on_policy: OnPolicyConfig = _opt(
        OnPolicyConfig(), "Training on the drafter's own continuations (mixed with the data)."
    )


@dataclass
class LossConfig:
    name: LossName = _opt("forward_kl", "Divergence between target and drafter distributions.")
    mix: dict[str, float] = _opt(
        {}, "Weighted mix of losses, e.g. {forward_kl: 0.5, ce: 0.5}; overrides name.",
        choices=LOSS_NAMES, ge=0,
    )  # fmt: skip
    temperature: float = _opt(1.0, "Softmax temperature of both distributions.", gt=0)
    beta: float = _opt(0.5, "JSD interpolation weight.", ge=0, le=1)
    teacher_top_k: int | None = _opt(None, "Keep only the target's top-k logits.", ge=1)


@dataclass
class TrainConfig:
    lr: float = _opt(3e-4, "Peak learning rate (AdamW).", gt=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay.", ge=0)
    warmup_steps: int = _opt(0, "Linear warm-up steps.", ge=0)
    schedule: Literal["cosine", "linear", "constant"] = _opt("cosine", "Decay after warm-up.")
    max_steps: int = _opt(1000, "Optimizer steps; 0 trains nothing (score only).", ge=0)
    max_minutes: float | None = _opt(
        None, "Wall-clock budget of the training steps in minutes (checkpoint scoring and "
        "held-out metrics not counted): the run stops after the step that reaches it, then "
        "saves and scores that step; max_steps still shapes the learning-rate schedule. null: "
        "no budget.", gt=0,
    )  # fmt: skip
    batch_size: int = _opt(8, "Sequences per device per micro-batch.", ge=1)
    grad_accum: int = _opt(1, "Micro-batches per optimizer step.", ge=1)
    length_group: int = _opt(
        1, "Micro-batches whose rows are drawn together and sorted by length, so a batch pads "
        "little; 1 draws each batch at random.", ge=1,
    )  # fmt: skip
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm; 0 is off.", ge=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = _opt(
        "auto", "Autocast of the drafter; auto: bf16 where the GPU supports it or, without a "
        "GPU, where the CPU has bfloat16 units (AVX512-BF16, AMX), else no."
    )  # fmt: skip
    save_every: int = _opt(200, "Checkpoint (and score) every this many steps.", ge=1)
    log_every: int = _opt(10, "Log metrics every this many steps.", ge=1)
    barrier_minutes: int = _opt(
        180, "How long processes wait for each other at a barrier (the main one regenerating "
        "data, caching the teacher or scoring) before the run fails.", ge=1,
    )  # fmt: skip
    resume: bool = _opt(True, "Resume from the latest checkpoint in the run directory.")
    trackers: list[str] = _opt([], "Extra trackers (jsonl is always on).", choices=TRACKERS)
    wandb_project: str = _opt("specdec", "Weights & Biases project.")


@dataclass
class EvalConfig:
    prompts: list[PromptSource] = _opt(
        [PromptSource("mtbench"), PromptSource("humaneval")], "Held-out prompt sources."
    )
    num_prompts: int = _opt(8, "Held-out prompts scored, in all, across the sources.", ge=1)
    k: int = _opt(4, "Draft tokens proposed per step.", ge=1)
    temperature: float = _opt(0.0, "Sampling temperature; 0 is greedy.", ge=0)
    top_k: int = _opt(0, "Top-k sampling; 0 is off.", ge=0)
    top_p: float = _opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    max_new_tokens: int = _opt(128, "Tokens generated per prompt.", ge=1)
    seed: int = _opt(0, "Sampling seed.")
    warmup_prompts: int = _opt(1, "Prompts run first and left out of timings.", ge=0)
    draft_forward: Literal["auto", "transformers", "float32", "float16", "bfloat16"] = _opt(
        "auto",
        "How the drafter's own network runs while decoding: auto is, on a CPU, "
        "float16 or the network's dtype, whichever multiplies its weights faster there "
        "(measured once per process; a draft model through specdec's compact forward where "
        "the architecture has one; a float16 copy of the weights where float16 wins), its own "
        "dtype elsewhere; a dtype names one; transformers is the network's own forward in its "
        "own dtype. Exact in any of them.",
    )
    draft_confidence: float = _opt(
        0.0,
        "A draft model stops drafting once its probability of its own chain so far falls "
        "below this (the first token is always drafted); 0 always drafts k. A dynamic tree "
        "expands a depth only while its best node's path is that likely. Exact either way.",
        ge=0,
        lt=1,
    )
    target_forward: Literal["auto", "compact", "transformers"] = _opt(
        "auto",
        "How the target runs, for plain and speculative decoding alike: auto is specdec's "
        "compact forward in the target's own dtype on a CPU where the architecture has one, "
        "else transformers' forward; compact asks for it on any device.",
    )
    tree: Literal["chain", "static", "dynamic"] = _opt(
        "chain",
        "What the drafter proposes each round: a chain of k tokens, a static tree (the rank "
        "paths of tree_choices) or a dynamic tree (EAGLE-2: depth k, expanded by the draft's "
        "confidence); trees are verified in one target forward.",
    )
    tree_top_k: int = _opt(
        4, "Dynamic trees: children per expanded node and nodes expanded per depth.", ge=1
    )
    tree_budget: int = _opt(
        0,
        "Dynamic trees: nodes verified per round; 0 chooses it each round from the measured "
        "cost of a target forward over 1 + m tokens and the draft's confidence.",
        ge=0,
    )
    tree_max_nodes: int = _opt(
        24, "The largest tree verified (the verify cost is measured up to it).", ge=1
    )
    tree_choices: list[list[int]] = _opt(
        [],
        "Static tree as rank paths, e.g. [[0], [1], [0, 0]] (the draft's top two tokens and "
        "the top one after the first); []: calibrated on the warm-up prompts from the paths "
        "dynamic trees get accepted, sized by the measured verify cost.",
    )


@dataclass
class ExportConfig:
    formats: list[str] = _opt(["hf"], "Export formats.", choices=export_formats)
    output_dir: str | None = _opt(None, "Where exports go; null: <run dir>/export.")


@dataclass
class Recipe:
    run: RunConfig = _opt(RunConfig(), "Name, directory, seed and logging of the run.")
    target: TargetConfig = _opt(TargetConfig(), "The frozen target model.")
    drafter: DrafterConfig = field(
        default_factory=default_drafter,
        metadata={"help": "The drafter being trained or scored; drafter.type picks the family."},
    )
    data: DataConfig = _opt(DataConfig(), "Training prompts and their regeneration.")
    loss: LossConfig = _opt(LossConfig(), "Distillation loss.")
    train: TrainConfig = _opt(TrainConfig(), "Optimisation and checkpointing.")
    eval: EvalConfig = _opt(EvalConfig(), "Scoring of checkpoints.")
    export: ExportConfig = _opt(ExportConfig(), "Export of the trained drafter.")

    @property
    def run_dir(self) -> Path:
        """The run directory: ``run.output_dir`` or ``runs/<run.name>``."""
        return Path(self.run.output_dir) if self.run.output_dir else Path("runs") / self.run.name
