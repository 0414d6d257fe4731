"""The distillation loop on the tiny debug recipe: what changes, what stays frozen, DDP
equivalence with gradient accumulation, and resuming a killed run."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import tiny_models
import torch
from safetensors.torch import load_file

from specdec.config import load_recipe, recipe_to_dict
from specdec.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug" / "tiny.yaml"
QUESTIONS = [
    "Tell me about the sea.",
    "Write a loop in Python.",
    "List three colors.",
    "What is two plus two?",
    "Name a fruit.",
    "Say hi to my friend.",
    "Count to five.",
    "Describe a cat.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target on disk plus training and held-out prompt files."""
    root = tmp_path_factory.mktemp("train")
    tiny_models.save_tiny(*tiny_models.tiny_llama(), root / "target")
    (root / "train.jsonl").write_text("\n".join(json.dumps({"prompt": q}) for q in QUESTIONS))
    (root / "eval.jsonl").write_text(
        "\n".join(json.dumps({"prompt": q + " Briefly."}) for q in QUESTIONS[:3])
    )
    return root


def overrides(setup: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"target.model={setup / 'target'}",
        f"run.output_dir={run_dir}",
        f"data.prompts=[{setup / 'train.jsonl'}]",
        f"eval.prompts=[{setup / 'eval.jsonl'}]",
        "drafter.init_from_target=false",
        *extra,
    ]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["train/loss"]) for m in lines if "train/loss" in m]


def launch(
    args: list[str],
    processes: int = 1,
    recipe: Path = RECIPE,
    fsdp: bool = False,
    script: Path = ROOT / "train" / "distill.py",
    **kwargs,
) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if processes == 1:
        cmd = [sys.executable, str(script)]
    else:
        # accelerate's --cpu launcher starts one process without MPI; the torchrun launcher
        # behind --multi_gpu starts N, and the trainer picks gloo when there is no CUDA
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--use_fsdp" if fsdp else "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(script),
        ]
    return subprocess.Popen(
        [*cmd, "--config", str(recipe), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_trainable_parameters_change_and_target_stays_frozen(setup, tmp_path, loaded_targets):
    from specdec.data.build import load_training_data
    from specdec.drafters.draft_model import build_draft_model
    from specdec.drafters.vocabulary import token_counts
    from specdec.training.loop import train

    seen = loaded_targets  # the target instance the run trains against
    run_dir = tmp_path / "run"
    # the draft starts as a copy of target layers: a tensor shared with the target would
    # train the target too
    args = ("train.save_every=100", "drafter.init_from_target=true")
    recipe = load_recipe(RECIPE, overrides(setup, run_dir, *args))
    target_before = load_file(setup / "target" / "model.safetensors")
    summary = train(recipe)
    assert summary["steps"] == 4
    target = seen[0]
    after = target.model.state_dict()
    assert set(target_before) <= set(after)
    for name, tensor in target_before.items():
        assert torch.equal(after[name], tensor), f"target {name} changed"
    assert all(not p.requires_grad for p in target.model.parameters())

    state = load_file(run_dir / "state" / "model.safetensors")
    ckpt = load_file(run_dir / "checkpoints" / "step-000004" / "model.safetensors")
    # the untrained drafter is rebuilt from the same seed: every tensor must have moved
    torch.manual_seed(recipe.run.seed)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    fresh = build_draft_model(target, recipe.drafter, token_counts(dataset, target.vocab_size))
    assert set(state) == {f"lm.{name}" for name in fresh.model.state_dict()}
    assert set(ckpt) == set(fresh.model.state_dict())
    for name, before in fresh.model.state_dict().items():
        assert not torch.equal(before, ckpt[name]), f"{name} did not change"
        assert torch.equal(state[f"lm.{name}"], ckpt[name])
    assert (run_dir / "best.json").exists() and (run_dir / "best").resolve().is_dir()
    score = json.loads((run_dir / "checkpoints" / "step-000004" / "score.json").read_text())
    assert score["greedy_match_rate"] == 1.0


def test_frozen_embeddings_stay_the_targets_while_the_rest_trains(setup, tmp_path):
    from specdec.training.loop import train

    run_dir = tmp_path / "run"
    args = ("train.save_every=100", "drafter.init_from_target=true", "drafter.num_layers=2")
    recipe = load_recipe(RECIPE, overrides(setup, run_dir, *args, "drafter.freeze_embeddings=true"))
    assert train(recipe)["steps"] == 4
    # a 2-layer draft of the 2-layer target starts as the target's copy, tensor for tensor
    target = load_file(setup / "target" / "model.safetensors")
    ckpt = load_file(run_dir / "checkpoints" / "step-000004" / "model.safetensors")
    assert set(ckpt) == set(target)
    frozen = "model.embed_tokens.weight"
    assert torch.equal(ckpt[frozen], target[frozen])
    for name, tensor in ckpt.items():  # the head is untied here: it trains
        if name != frozen:
            assert not torch.equal(tensor, target[name]), f"{name} did not change"


def test_ddp_two_processes_match_one_with_accumulation(setup, tmp_path):
    args = ("train.save_every=100", "train.warmup_steps=0")  # the first update counts too
    one = launch(overrides(setup, tmp_path / "one", "train.grad_accum=2", *args))
    finish(one)
    two = launch(overrides(setup, tmp_path / "two", "train.grad_accum=1", *args), processes=2)
    finish(two)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-4, abs=1e-6)
    # AdamW hides a gradient scaled by the process count; the logged norm does not
    norms = [metric(tmp_path / run, "train/grad_norm") for run in ("one", "two")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    w1 = load_file(tmp_path / "one" / "state" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "state" / "model.safetensors")
    assert set(w1) == set(w2)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-4)


def test_fsdp_two_processes_match_one_with_accumulation_and_resume_after_sigkill(setup, tmp_path):
    """FSDP over gloo: each process holds half the drafter, the updates are those of one
    process with all the micro-batches, a run killed after a save resumes to the same weights."""
    args = ("train.max_steps=8", "train.save_every=2", "train.warmup_steps=0", "train.batch_size=1")
    finish(launch(overrides(setup, tmp_path / "one", "train.grad_accum=4", *args)))
    run_dir = tmp_path / "fsdp"  # two micro-batches a process: gradients accumulate unsynced
    fsdp = overrides(setup, run_dir, "train.grad_accum=2", *args)
    proc = launch(fsdp, processes=2, fsdp=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (run_dir / "checkpoints" / "step-000002").exists():
        time.sleep(0.02)
    # the launcher and its workers (torchrun starts them in sessions of their own)
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    out, _ = proc.communicate()
    held = re.findall(
        r"sharded across 2 processes in (\d+) units; this process holds (\d+) of its (\d+)", out
    )
    assert len(held) == 2, out[-3000:]  # both processes, each with its half
    assert all(int(units) >= 2 and 2 * int(a) == int(b) for units, a, b in held)
    assert losses(run_dir)[-1][0] < 8  # killed mid-run
    out = finish(launch(fsdp, processes=2, fsdp=True))
    assert "resumed" in out
    assert (run_dir / "state" / "sharded_state.pt").is_file()
    got, expected = losses(run_dir), losses(tmp_path / "one")
    assert [s for s, _ in got] == [s for s, _ in expected] == list(range(1, 9))
    assert [x for _, x in got] == pytest.approx([x for _, x in expected], rel=1e-4, abs=1e-6)
    norms = [metric(tmp_path / run, "train/grad_norm") for run in ("one", "fsdp")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    for step in ("step-000002", "step-000008"):  # saved from the gathered weights, and scored
        w1 = load_file(tmp_path / "one" / "checkpoints" / step / "model.safetensors")
        w2 = load_file(run_dir / "checkpoints" / step / "model.safetensors")
        assert set(w1) == set(w2)
        for name in w1:
            torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-4)
        assert (run_dir / "checkpoints" / step / "score.json").is_file()


def metric(run_dir: Path, key: str) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m[key] for m in lines if key in m]


THREADS_AFTER_RUN = """
import os, sys
from specdec.cli import main
code = main(["train", *sys.argv[1:]])
names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
print(f"gloo threads after the run: {sum('gloo' in n for n in names)}", flush=True)
sys.exit(code)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_process_group_is_gone_when_the_run_returns(setup, tmp_path, fsdp):
    """A process group that outlives the run is torn down with the interpreter, where gloo's
    threads can abort a process that finished its run (seen under FSDP): when ``train``
    returns, no gloo thread is left in either process."""
    script = tmp_path / "threads_after_run.py"
    script.write_text(THREADS_AFTER_RUN)
    args = overrides(setup, tmp_path / "run", "train.max_steps=2", "train.save_every=100")
    out = finish(launch(args, processes=2, fsdp=fsdp, script=script))
    assert out.count("gloo threads after the run: 0") == 2, out[-3000:]


def test_fsdp_refuses_a_loss_scaler():
    """fp16 on a GPU scales the loss; the sharded path would clip and apply scaled gradients.
    (No GPU here: the accelerator's scaler is stood in for.)"""
    from types import SimpleNamespace

    from specdec.training import sharding

    with pytest.raises(ConfigError, match="fp16 scales the loss, which sharded training does"):
        sharding.check_precision(SimpleNamespace(scaler=object()))
    sharding.check_precision(SimpleNamespace(scaler=None))  # bf16, or a CPU


def test_auto_precision_is_bf16_only_on_a_cpu_with_bf16_units(monkeypatch, tmp_path):
    """``mixed_precision: auto`` without a GPU: bf16 where /proc/cpuinfo's flags line names
    AVX512-BF16 or AMX-BF16 (bfloat16 products in hardware), no elsewhere (emulated bf16 is
    no faster), and the accelerator is made with what auto chose."""
    from specdec.training import setup as setup_module

    zen4 = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512bw avx512_bf16 avx512_vnni\n"
    sapphire_rapids = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
    skylake = "processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512vl avx512_vnni\n"
    elsewhere = "processor\t: 0\nbugs\t\t: avx512_bf16\nflags\t\t: fpu avx2\n"
    assert setup_module.cpu_computes_bf16(zen4)
    assert setup_module.cpu_computes_bf16(sapphire_rapids)
    assert not setup_module.cpu_computes_bf16(skylake)
    assert not setup_module.cpu_computes_bf16(elsewhere)  # only the flags line counts
    assert not setup_module.cpu_computes_bf16("")

    made = {}
    monkeypatch.setattr(setup_module, "Accelerator", lambda **kwargs: made.update(kwargs))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = load_recipe(str(RECIPE), ["train.mixed_precision=auto"])
    for cpuinfo, expected in ((zen4, "bf16"), (skylake, "no")):
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        monkeypatch.setattr(setup_module, "CPUINFO", str(tmp_path / "cpuinfo"))
        setup_module.make_accelerator(recipe)
        assert made["mixed_precision"] == expected
    monkeypatch.setattr(setup_module, "CPUINFO", str(tmp_path / "missing"))
    setup_module.make_accelerator(recipe)
    assert made["mixed_precision"] == "no"
    (tmp_path / "cpuinfo").write_text(zen4)
    monkeypatch.setattr(setup_module, "CPUINFO", str(tmp_path / "cpuinfo"))
    setup_module.make_accelerator(load_recipe(str(RECIPE), ["train.mixed_precision=no"]))
    assert made["mixed_precision"] == "no"  # an explicit choice stays


def test_runs_of_other_precisions_follow_in_one_process(setup, tmp_path):
    """accelerate keeps one state per process and refuses a second precision: a process that
    trains one recipe after another (a sweep, a notebook) trains each in its own."""
    from accelerate.state import AcceleratorState

    from specdec.training.loop import train

    for i, precision in enumerate(["no", "bf16", "no"]):
        args = ("train.max_steps=1", "train.save_every=100", f"train.mixed_precision={precision}")
        recipe = load_recipe(RECIPE, overrides(setup, tmp_path / f"run{i}", *args))
        assert train(recipe)["steps"] == 1
        assert AcceleratorState().mixed_precision == precision


def test_kept_responses_train_beside_regenerated_ones(setup, tmp_path):
    """`responses: keep` rows are trained on as they are; only the others are regenerated."""
    from specdec.data.build import build_data, load_training_data
    from specdec.target import FrozenTarget

    answers = ["Blue is a colour of the sea.", "Two plus two is four, always."]
    kept = tmp_path / "kept.jsonl"
    chats = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in zip(["Name a blue thing.", "Add two and two."], answers, strict=True)
    ]
    kept.write_text("\n".join(json.dumps({"messages": chat}) for chat in chats))
    sources = (  # the kept file in two disjoint slices
        f"[{{source: {setup / 'train.jsonl'}}}, {{source: {kept}, responses: keep, limit: 1}}, "
        f"{{source: {kept}, responses: keep, offset: 1}}]"
    )
    extra = ["data.max_prompts=null", f"data.prompts={sources}"]
    recipe = load_recipe(RECIPE, overrides(setup, tmp_path / "run", *extra))
    target = FrozenTarget.from_config(recipe.target)
    report = build_data(recipe, target, progress=False)
    assert report.num_kept == 2 and report.regenerate["num_done"] == len(QUESTIONS)
    dataset, _ = load_training_data(recipe, target.tokenizer)
    assert len(dataset) == len(QUESTIONS) + 2
    assert sorted(set(dataset["source"])) == ["data/kept", "target/train"]
    by_source = dict(zip(dataset["source"], dataset["target_written"], strict=True))
    assert by_source == {"data/kept": False, "target/train": True}
    assert sum(dataset["target_written"]) == len(QUESTIONS)
    texts = [target.tokenizer.decode(ids) for ids in dataset["input_ids"]]
    for answer in answers:
        assert sum(answer in t for t in texts) == 1

    # one source regenerated and kept: each prompt's two rows share its id (held out together)
    twins = f"[{{source: {kept}}}, {{source: {kept}, responses: keep}}]"
    extra = ["data.max_prompts=null", f"data.prompts={twins}"]
    both = load_recipe(RECIPE, overrides(setup, tmp_path / "twins", *extra))
    build_data(both, target, progress=False)
    dataset, _ = load_training_data(both, target.tokenizer)
    pairs = sorted(zip(dataset["id"], dataset["target_written"], strict=True))
    ids = sorted({row_id for row_id, _ in pairs})
    assert len(ids) == 2 and pairs == [(i, w) for i in ids for w in (False, True)]

    no_answers = f"[{{source: {setup / 'train.jsonl'}, responses: keep}}]"
    bad = load_recipe(RECIPE, overrides(setup, tmp_path / "bad") + [f"data.prompts={no_answers}"])
    with pytest.raises(
        DataError, match=r"data.prompts\[0\].responses: 'keep', but .* no assistant"
    ):
        build_data(bad, target, progress=False)


def test_resume_with_another_recipe_is_refused(setup, tmp_path):
    from specdec.training.loop import train

    run_dir = tmp_path / "run"
    train(load_recipe(RECIPE, overrides(setup, run_dir, "train.max_steps=2")))
    with pytest.raises(ConfigError, match="different recipe.*train.lr"):
        train(load_recipe(RECIPE, overrides(setup, run_dir, "train.max_steps=4", "train.lr=0.1")))


def test_run_from_before_an_option_existed_resumes_at_its_default(setup, tmp_path):
    """A run directory whose recipe.yaml predates an option (the key is absent) ran at that
    option's default: resuming it at the default is the same run, at another value it is not."""
    import yaml

    from specdec.training.checkpoint import check_same_recipe

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = load_recipe(RECIPE, overrides(setup, run_dir))
    assert recipe.data.loss_on == "assistant"  # the default, as the key's absence means
    older = recipe_to_dict(recipe)
    del older["data"]["loss_on"]
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(older))
    check_same_recipe(run_dir, recipe)
    other = load_recipe(RECIPE, overrides(setup, run_dir, "data.loss_on=all"))
    with pytest.raises(ConfigError, match=r"different recipe \(data.loss_on: 'assistant' there"):
        check_same_recipe(run_dir, other)


def test_empty_eval_prompts_are_refused(setup, tmp_path):
    from specdec.training.loop import train

    recipe = load_recipe(RECIPE, overrides(setup, tmp_path / "run", "eval.prompts=[]"))
    with pytest.raises(ConfigError, match="eval.prompts"):
        train(recipe)


def test_tensorboard_tracker_writes_into_the_run(setup, tmp_path):
    from specdec.training.loop import train

    run_dir = tmp_path / "run"
    train(
        load_recipe(
            RECIPE, overrides(setup, run_dir, "train.max_steps=2", "train.trackers=[tensorboard]")
        )
    )
    assert list(run_dir.rglob("events.out.tfevents.*"))
    assert losses(run_dir)  # the jsonl log is written as well


def test_drafter_with_another_vocabulary_is_refused(setup, tmp_path):
    from specdec.drafters.draft_model import build_draft_model
    from specdec.errors import ModelError
    from specdec.target import FrozenTarget
    from specdec.training.loop import train

    other = FrozenTarget(*tiny_models.tiny_qwen2())
    recipe = load_recipe(RECIPE, overrides(setup, tmp_path / "run"))
    drafter = build_draft_model(other, recipe.drafter)
    drafter.tokenizer = other.tokenizer
    drafter.save(tmp_path / "qwen-drafter", target_name="tiny-qwen2")
    recipe = load_recipe(
        RECIPE,
        overrides(setup, tmp_path / "run", f"drafter.from_pretrained={tmp_path}/qwen-drafter"),
    )
    with pytest.raises(ModelError, match="vocabulary"):
        train(recipe)


def test_length_groups_cover_each_epoch_once_and_pad_less():
    from datasets import Dataset

    from specdec.training.step import micro_batch

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(2, 60, (64,), generator=g).tolist()
    rows = {"input_ids": [[7] * n for n in sizes], "loss_mask": [[1] * n for n in sizes]}
    rows["input_ids"] = [[i] + ids[1:] for i, ids in enumerate(rows["input_ids"])]  # row id
    dataset = Dataset.from_dict(rows)
    lengths = torch.tensor(sizes)

    def epoch(group):
        batches = [micro_batch(dataset, i, 4, 0, 0, lengths, group) for i in range(16)]
        seen = sorted(int(b["input_ids"][r, 0]) for b in batches for r in range(4))
        padding = sum(int((b["attention_mask"] == 0).sum()) for b in batches)
        return seen, padding

    grouped, padded_grouped = epoch(4)
    plain, padded_plain = epoch(1)
    assert grouped == plain == list(range(64))  # every row once per epoch
    assert padded_grouped < padded_plain / 2


def test_wall_clock_budget_stops_saves_and_resumes(setup, tmp_path, monkeypatch):
    """train.max_minutes: with a clock that advances one second per reading every step costs
    one second, so a budget of 0.1 minutes stops the run after step 6 of 50 and saves and
    scores it; relaunched with the same budget it trains no more (and scores that step if a kill
    left it unscored), with a larger one it goes on (the budget may change between a run and
    its resumption)."""
    from itertools import count

    from specdec.training import loop

    ticks = count()
    monkeypatch.setattr(loop, "clock", lambda: float(next(ticks)))
    run_dir = tmp_path / "run"

    def run(minutes: float) -> dict:
        args = ("train.max_steps=50", "train.save_every=100", f"train.max_minutes={minutes}")
        return loop.train(load_recipe(RECIPE, overrides(setup, run_dir, *args)))

    first = run(0.1)
    assert (first["steps"], first["seconds"]) == (6, 6.0)
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert (
        saved == ["step-000006"] and (run_dir / "checkpoints" / saved[0] / "score.json").is_file()
    )
    assert losses(run_dir)[-1][0] == 6  # the last step is logged too
    score = run_dir / "checkpoints" / "step-000006" / "score.json"
    score.unlink()  # as if killed between the state's save and the checkpoint's score
    assert (run(0.1)["steps"], [s for s, _ in losses(run_dir)][-1]) == (6, 6)
    assert score.is_file()  # scored when it resumed, without training more
    assert run(0.15)["steps"] == 9
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step-000009"


def test_wall_clock_budget_under_ddp_stops_every_process_at_one_step(setup, tmp_path):
    """Two processes over gloo, a budget (6 ms) the first step spends: the clocks are gathered
    without a hang, both processes stop after that step, and it is saved and scored once."""
    args = ("train.max_steps=50", "train.save_every=100", "train.max_minutes=0.0001")
    finish(launch(overrides(setup, tmp_path / "two", *args), processes=2))
    assert [s for s, _ in losses(tmp_path / "two")] == [1]
    saved = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert saved == ["step-000001"]
    assert (tmp_path / "two" / "checkpoints" / saved[0] / "score.json").is_file()


def test_the_slowest_process_clock_decides():
    """``spend`` with another process's clock at 90 s (a stand-in for the gathered clocks):
    this process, at 30 s, stops too with a budget of one minute, and keeps the 90 s."""
    from types import SimpleNamespace

    from specdec.training.checkpoint import TrainState
    from specdec.training.loop import spend

    class Gloo:
        device = torch.device("cpu")

        def gather(self, mine):
            return torch.cat([mine, torch.tensor([90.0], dtype=mine.dtype)])

    recipe = SimpleNamespace(train=SimpleNamespace(max_minutes=1.0))
    run = SimpleNamespace(state=TrainState(), recipe=recipe, accelerator=Gloo())
    assert spend(run, 30.0) and run.state.seconds == 90.0
    run.state.seconds, recipe.train.max_minutes = 0.0, 2.0
    assert not spend(run, 30.0) and run.state.seconds == 90.0
