"""The teacher cache: what it reads back against the target's own forward (exact for float32
over the full vocabulary, bounded for the lossy storage), resuming after a kill without
duplicates, refusing caches of something else, and training from it equal to training online."""

import fcntl
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from datasets import Dataset
from safetensors.torch import load_file
from test_training import setup

from specdec.data import cache as cache_mod
from specdec.data.cache import build_cache, fingerprint
from specdec.data.cache_read import TeacherCache
from specdec.errors import DataError
from specdec.sparse_teacher import SparseTeacher
from specdec.target import FrozenTarget

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (0, 1)
files = setup  # the tiny target and prompt files of the training tests


@pytest.fixture(scope="module")
def target():
    model, tokenizer = tiny_models.tiny_llama()
    return FrozenTarget(model, tokenizer, name="tiny")


def rows(n: int = 7, seed: int = 0, vocab: int = 384) -> Dataset:
    """Rows of different lengths with a prompt part (no loss) and an answer part."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        length = 6 + 5 * i % 17
        ids.append(torch.randint(4, vocab, (length,), generator=g).tolist())
        prompt = 2 + i % 4
        masks.append([0] * prompt + [1] * (length - prompt))
    return Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


def spec(top_k=0, dtype="float32", shard_rows=3, batch_size=2):
    return SimpleNamespace(top_k=top_k, dtype=dtype, shard_rows=shard_rows, batch_size=batch_size)


def make(target, dataset, out: Path, layers=LAYERS, **kw) -> TeacherCache:
    cfg = spec(**kw)
    fp = fingerprint(target, SimpleNamespace(dtype="float32"), dataset, layers, cfg)
    build_cache(target, dataset, fp, out, cfg.batch_size, progress=False)
    return TeacherCache(out, fp)


def reference(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The row alone through transformers: log-probabilities [n, V], hidden states [n, L, H]."""
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    log_p = torch.log_softmax(out.logits[0].float(), -1)
    hidden = torch.stack([out.hidden_states[i + 1][0] for i in LAYERS], 1)
    return log_p, hidden


def taught(mask: list[int]) -> list[int]:
    return [t for t in range(len(mask) - 1) if mask[t + 1] == 1]


def test_full_float32_cache_reads_back_the_target(target, tmp_path):
    data = rows()
    cache = make(target, data, tmp_path / "c")
    for i in range(len(data)):
        row, (log_p, hidden) = cache.row(i), reference(target, data[i]["input_ids"])
        where = taught(data[i]["loss_mask"])
        assert row["positions"].tolist() == where
        torch.testing.assert_close(row["log_p"], log_p[where], atol=1e-5, rtol=0)
        torch.testing.assert_close(row["features"], hidden, atol=1e-5, rtol=1e-5)
        assert row["input_ids"].tolist() == data[i]["input_ids"]


def test_top_k_rows_keep_the_top_and_spread_the_rest_evenly(target, tmp_path):
    data, k = rows(), 16
    cache = make(target, data, tmp_path / "c", top_k=k)
    vocab = target.vocab_size
    for i in range(len(data)):
        log_p = reference(target, data[i]["input_ids"])[0][taught(data[i]["loss_mask"])]
        got = cache.row(i)["log_p"]
        top = log_p.topk(k, -1)
        torch.testing.assert_close(got.gather(1, top.indices), top.values, atol=1e-5, rtol=0)
        rest = 1 - top.values.exp().sum(-1)
        tail = torch.ones_like(got, dtype=torch.bool).scatter_(1, top.indices, False)
        expected = (rest / (vocab - k)).log()[:, None].expand_as(got)[tail]
        torch.testing.assert_close(got[tail], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.logsumexp(-1), torch.zeros(len(got)), atol=1e-5, rtol=0)
        assert torch.equal(got.argmax(-1), log_p.argmax(-1))


@pytest.mark.parametrize(
    ("dtype", "relative"), [("float16", 2**-11), ("bfloat16", 2**-8), ("fp8", 2**-4)]
)
def test_lossy_storage_stays_within_its_rounding(target, tmp_path, dtype, relative):
    data = rows()
    cache = make(target, data, tmp_path / "c", dtype=dtype)
    for i in range(len(data)):
        log_p, hidden = reference(target, data[i]["input_ids"])
        row = cache.row(i)
        for got, want in (
            (row["log_p"], log_p[taught(data[i]["loss_mask"])]),
            (row["features"], hidden),
        ):
            # fp8: below its smallest normal (2^-6 of the scale) a value is rounded to 2^-9 steps
            floor = want.abs().amax(-1, keepdim=True) / 448 * 2**-10 if dtype == "fp8" else 0
            assert ((got - want).abs() <= relative * want.abs() + floor + 1e-6).all(), dtype
        assert not torch.equal(row["features"], hidden)  # it is lossy: the test can tell


def by_hand(teacher) -> torch.Tensor:
    """A sparse teacher's ``[N, D]`` log-probabilities written out entry by entry."""
    if isinstance(teacher, torch.Tensor):
        return teacher
    out = teacher.fill[:, None].repeat(1, teacher.width)
    rows = zip(teacher.values.tolist(), teacher.cols.tolist(), strict=True)
    for r, (values, cols) in enumerate(rows):
        for value, col in zip(values, cols, strict=True):
            if value > -math.inf:
                out[r, col] = value
    return out


@pytest.mark.parametrize(("top_k", "draft"), [(8, None), (8, "some"), (0, "some")])
def test_batch_is_the_teacher_over_the_draft_vocabulary_at_each_rows_positions(
    target, tmp_path, top_k, draft
):
    """Against the read-back rows (tested above) restricted to the draft vocabulary by hand:
    log-probabilities at the teacher positions alone, row after row, the top token's draft
    index."""
    data, vocab = rows(), target.vocab_size
    g = torch.Generator().manual_seed(1)
    draft_ids = None if draft is None else torch.randperm(vocab, generator=g)[:100].sort().values
    cfg = spec(top_k=top_k)
    fp = fingerprint(target, SimpleNamespace(dtype="float32"), data, LAYERS, cfg)
    build_cache(target, data, fp, tmp_path / "c", cfg.batch_size, progress=False)
    cache = TeacherCache(tmp_path / "c", fp, draft_ids)
    order, width = [4, 0, 2], max(len(data[i]["input_ids"]) for i in (4, 0, 2)) + 3
    ids = torch.zeros(3, width, dtype=torch.long)
    for b, i in enumerate(order):
        ids[b, : len(data[i]["input_ids"])] = torch.tensor(data[i]["input_ids"])
    batch = cache.batch(order, width, ids)
    columns = list(range(vocab)) if draft_ids is None else draft_ids.tolist()
    assert batch["teacher_rows"].shape == (3, width)
    assert isinstance(batch["teacher_log_probs"], SparseTeacher) == bool(top_k)
    log_p = by_hand(batch["teacher_log_probs"])
    assert log_p.shape[-1] == len(columns)
    start = 0
    for b, i in enumerate(order):
        row, n = cache.row(i), len(data[i]["input_ids"])
        where = taught(data[i]["loss_mask"])
        assert batch["teacher_rows"][b].nonzero().flatten().tolist() == where
        mine = slice(start, start + len(where))  # this row's positions, after the earlier rows'
        start += len(where)
        assert torch.equal(log_p[mine], row["log_p"][:, columns])
        top = row["log_p"].argmax(-1).tolist()
        expected = [columns.index(t) if t in columns else -1 for t in top]
        assert batch["teacher_best"][mine].tolist() == expected
        assert torch.equal(batch["features"][:, b, :n], row["features"].transpose(0, 1))
        assert not batch["features"][:, b, n:].any()
    assert start == len(log_p) == len(batch["teacher_best"])
    if draft_ids is not None:  # some top tokens fall outside a 100-token draft vocabulary
        assert (batch["teacher_best"] == -1).any()
    ids[1, 0] += 1
    with pytest.raises(DataError, match="row 0 holds other tokens"):
        cache.batch(order, width, ids)


def test_a_step_from_a_top_k_cache_equals_the_step_from_its_teacher_written_out(target, tmp_path):
    """The training step reads a top-k cache's teacher in its sparse form: the loss, the
    gradient of every weight and every metric equal those of the same step with that teacher
    written out in full by hand (an EAGLE-3 head: three draft steps over a reduced vocabulary,
    some top tokens outside it)."""
    from specdec import drafters
    from specdec.drafters.eagle3 import Eagle3Config
    from specdec.training.step import collate, drafter_loss

    data = rows()
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1).float()
    drafter = drafters.build(target, Eagle3Config(draft_vocab_size=64, ttt_steps=3), counts)
    cfg = spec(top_k=8, dtype="float16")
    layers = drafter.required_target_layers
    fp = fingerprint(target, SimpleNamespace(dtype="float32"), data, layers, cfg)
    build_cache(target, data, fp, tmp_path / "c", cfg.batch_size, progress=False)
    cache = TeacherCache(tmp_path / "c", fp, drafter.draft_ids)
    sparse = collate(data, [4, 0, 2, 6], 0, cache)
    assert isinstance(sparse["teacher_log_probs"], SparseTeacher)
    dense = dict(sparse, teacher_log_probs=by_hand(sparse["teacher_log_probs"]))
    assert (sparse["teacher_best"] == -1).any()  # some top tokens lie outside the 64
    loss_cfg = SimpleNamespace(
        mix=None, name="forward_kl", temperature=1.0, beta=0.5, teacher_top_k=None
    )
    counted = drafter.loss_masks(sparse["loss_mask"]).sum(dim=(1, 2)).float()
    model, results = drafter.module, []
    for batch in (sparse, dense):
        model.zero_grad()
        loss, metrics, _ = drafter_loss(drafter, model, None, batch, loss_cfg, counted)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (loss, metrics, grads), (loss_d, metrics_d, grads_d) = results
    torch.testing.assert_close(loss, loss_d, atol=1e-5, rtol=1e-5)
    assert metrics.keys() == metrics_d.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], metrics_d[key], atol=1e-5, rtol=1e-5, msg=key)
    assert grads.keys() == grads_d.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], grads_d[name], atol=1e-5, rtol=1e-4, msg=name)


def shards(out: Path) -> dict:
    return {p.name: load_file(p) for p in sorted(out.glob("shard-*.safetensors"))}


def test_a_cache_killed_between_shards_resumes_with_the_missing_ones(target, tmp_path, monkeypatch):
    data = rows(n=8)
    make(target, data, tmp_path / "whole", top_k=8)

    real_replace, calls = os.replace, []

    def dies_on_second_shard(src, dst):
        if str(dst).endswith(".safetensors"):
            calls.append(dst)
            if len(calls) == 2:
                raise KeyboardInterrupt  # killed after writing the shard, before its rename
        real_replace(src, dst)

    monkeypatch.setattr(cache_mod.os, "replace", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        make(target, data, tmp_path / "c", top_k=8)
    monkeypatch.setattr(cache_mod.os, "replace", real_replace)
    assert [p.name for p in (tmp_path / "c").glob("*.tmp")] == ["shard-00001.safetensors.tmp"]
    assert not json.loads((tmp_path / "c" / "manifest.json").read_text())["complete"]
    with pytest.raises(DataError, match="no complete teacher cache"):
        TeacherCache(
            tmp_path / "c",
            fingerprint(target, SimpleNamespace(dtype="float32"), data, LAYERS, spec(top_k=8)),
        )

    encoded = []
    real_encode = cache_mod.encode_rows
    monkeypatch.setattr(
        cache_mod, "encode_rows", lambda t, d, r, *a: encoded.append(r) or real_encode(t, d, r, *a)
    )
    make(target, data, tmp_path / "c", top_k=8)
    assert encoded == [range(3, 6), range(6, 8)]  # shard 0 was kept, not recomputed
    assert not list((tmp_path / "c").glob("*.tmp"))
    whole, resumed = shards(tmp_path / "whole"), shards(tmp_path / "c")
    assert whole.keys() == resumed.keys()
    for name, tensors in whole.items():
        for key, value in tensors.items():
            assert torch.equal(resumed[name][key], value), (name, key)


KILLED = """
import sys, time
sys.path.insert(0, {tests!r})
import tiny_models
from test_cache import make, rows
from specdec.data import cache as cache_mod
from specdec.target import FrozenTarget
slow = cache_mod.encode_rows
def encode(*a):
    time.sleep(0.3)
    return slow(*a)
cache_mod.encode_rows = encode
model, tok = tiny_models.tiny_llama()
out = __import__("pathlib").Path({out!r})
make(FrozenTarget(model, tok), rows(n=12), out, top_k=8, shard_rows=1)
"""


def test_sigkill_while_caching_resumes_without_duplicates_or_losses(target, tmp_path):
    out = tmp_path / "c"
    script = KILLED.format(tests=str(ROOT / "tests"), out=str(out))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.time() + 120
    while len(list(out.glob("shard-*.safetensors"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(out.glob("shard-*.safetensors")))
    assert 3 <= done < 12, "the kill came before or after the cache was made"
    cache = make(target, rows(n=12), out, top_k=8, shard_rows=1)
    whole = make(target, rows(n=12), tmp_path / "whole", top_k=8, shard_rows=1)
    assert len(cache.shards) == 12
    for i in range(12):
        a, b = cache.row(i), whole.row(i)
        assert all(torch.equal(a[key], b[key]) for key in a), i


def test_a_cache_another_process_is_writing_is_refused(target, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    with (out / ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a second writer's run would hold it
        with pytest.raises(DataError, match="being written by another process"):
            make(target, rows(n=4), out, top_k=8, shard_rows=1)
        assert not list(out.glob("shard-*")), "the refused writer wrote"
    assert len(make(target, rows(n=4), out, top_k=8, shard_rows=1).shards) == 4


def test_refuses_a_cache_of_something_else(target, tmp_path):
    data = rows()
    make(target, data, tmp_path / "c", top_k=8, dtype="float16")
    for key, change in [
        ("top_k", {"top_k": 16}),
        ("dtype", {"dtype": "bfloat16"}),
        ("layers", {"layers": (0, 1, 2)}),
    ]:
        with pytest.raises(DataError, match=f"another {key} "):
            make(target, data, tmp_path / "c", **{"top_k": 8, "dtype": "float16", **change})
    with pytest.raises(DataError, match="another data_sha256"):
        make(target, rows(seed=1), tmp_path / "c", top_k=8, dtype="float16")
    other, tok = tiny_models.tiny_llama(seed=1)
    with pytest.raises(DataError, match="another target"):
        make(FrozenTarget(other, tok), data, tmp_path / "c", top_k=8, dtype="float16")

    (tmp_path / "c" / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest.json is not valid JSON"):
        make(target, data, tmp_path / "c", top_k=8, dtype="float16")
    (tmp_path / "c" / "manifest.json").unlink()
    with pytest.raises(DataError, match="has shards but no manifest.json"):
        make(target, data, tmp_path / "c", top_k=8, dtype="float16")


def test_a_cache_of_more_layers_serves_drafters_that_read_fewer(target, tmp_path):
    data = rows()
    make(target, data, tmp_path / "c", top_k=8)
    fewer = make(target, data, tmp_path / "c", layers=(1,), top_k=8)  # nothing to do
    none = make(target, data, tmp_path / "c", layers=(), top_k=8)
    for i in range(len(data)):
        hidden = reference(target, data[i]["input_ids"])[1]
        torch.testing.assert_close(fewer.row(i)["features"], hidden[:, 1:], atol=1e-5, rtol=1e-5)
        assert "features" not in none.row(i)
        assert torch.equal(none.row(i)["log_p"], fewer.row(i)["log_p"])
    ids = torch.tensor([data[3]["input_ids"]])
    assert "features" not in none.batch([3], ids.shape[1], ids)
    assert "teacher_log_probs" in none.batch([3], ids.shape[1], ids)
    assert fewer.batch([3], ids.shape[1], ids)["features"].shape[0] == 1
    with pytest.raises(DataError, match="another layers"):
        make(target, data, tmp_path / "one", layers=(1,), top_k=8)
        make(target, data, tmp_path / "one", layers=(0, 1), top_k=8)


def test_a_truncated_shard_is_named(target, tmp_path):
    data = rows()
    make(target, data, tmp_path / "c", top_k=8)
    shard = tmp_path / "c" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    fp = fingerprint(target, SimpleNamespace(dtype="float32"), data, LAYERS, spec(top_k=8))
    with pytest.raises(DataError, match="shard-00001.safetensors: unreadable teacher shard"):
        TeacherCache(tmp_path / "c", fp)


def test_estimate_matches_the_files_within_their_headers(target, tmp_path):
    data = rows(n=12)
    for kw in ({"top_k": 0, "dtype": "float16"}, {"top_k": 8, "dtype": "fp8"}):
        out = tmp_path / str(kw["top_k"])
        make(target, data, out, **kw)
        manifest = json.loads((out / "manifest.json").read_text())
        estimate = cache_mod.estimate_bytes(data, manifest["fingerprint"])
        # each shard adds a JSON header and two offset tables
        assert estimate <= manifest["bytes"] <= estimate + manifest["shards"] * 2000


@pytest.mark.parametrize("recipe", ["tiny.yaml", "tiny_eagle3.yaml"])
def test_training_from_the_full_cache_equals_training_online(files, tmp_path, recipe, monkeypatch):
    """float32 over the full vocabulary: the same teacher, so the same weights after 3 steps
    (to float rounding: the cache's batches are padded differently). From the cache the
    target's forward runs only to build it."""
    from specdec.config import load_recipe
    from specdec.target import FrozenTarget
    from specdec.training.loop import train

    # per call of the target's forward: was it building the cache, or the drafter (EAGLE-3's
    # head starts from one forward on a probe text), rather than teaching a step?
    forwards: list[bool] = []
    real = FrozenTarget.forward

    def counted(self, *args, **kwargs):
        frame, building = sys._getframe(), False
        while frame is not None and not building:
            building = frame.f_code.co_name in ("encode_rows", "init_from_target")
            frame = frame.f_back
        forwards.append(building)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FrozenTarget, "forward", counted)

    def run(name: str, *extra: str) -> dict:
        recipe_path = ROOT / "recipes" / "debug" / recipe
        sets = [
            f"target.model={files / 'target'}",
            f"run.output_dir={tmp_path / name}",
            f"data.prompts=[{files / 'train.jsonl'}]",
            f"eval.prompts=[{files / 'eval.jsonl'}]",
            f"data.dataset_dir={tmp_path / 'data'}",
            "train.warmup_steps=0",
            "train.max_steps=3",
            "train.save_every=100",
            *(["drafter.init_from_target=false"] if recipe == "tiny.yaml" else []),
            *extra,
        ]
        train(load_recipe(recipe_path, sets))
        return load_file(tmp_path / name / "state" / "model.safetensors")

    online = run("online")
    assert not all(forwards)  # the teacher of every step
    forwards.clear()
    cached = run("cached", "data.teacher=cache", "data.cache.top_k=0", "data.cache.dtype=float32")
    assert any(forwards) and all(forwards)  # the cache's one pass, and nothing after it
    lossy = run("lossy", "data.teacher=cache", "data.cache.top_k=4", "data.cache.dtype=fp8")
    assert (tmp_path / "cached" / "teacher-cache" / "manifest.json").exists()
    assert online.keys() == cached.keys()
    for key, value in online.items():
        torch.testing.assert_close(cached[key], value, atol=1e-5, rtol=1e-4, msg=key)
    # the test can tell teachers apart: a lossy cache trains other weights
    assert any(not torch.allclose(lossy[k], v, atol=1e-4) for k, v in online.items())


def command_sets(files, tmp_path) -> list[str]:
    """The debug recipes' overrides for the tiny target and prompt files, run in ``tmp_path``."""
    return [
        f"target.model={files / 'target'}",
        f"run.output_dir={tmp_path / 'run'}",
        f"data.prompts=[{files / 'train.jsonl'}]",
        f"eval.prompts=[{files / 'eval.jsonl'}]",
        "data.cache.shard_rows=3",
    ]


def test_cache_command_builds_resumes_and_refuses_in_one_line(files, tmp_path, capsys):
    from specdec.cli import main

    sets = command_sets(files, tmp_path)
    recipe = str(ROOT / "recipes" / "debug" / "tiny_eagle3.yaml")
    assert main(["data", "cache", "--config", recipe, "--set", *sets]) == 0
    line = capsys.readouterr().out.strip()
    manifest = json.loads((tmp_path / "run" / "teacher-cache" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards"] == 3
    assert f"{manifest['fingerprint']['rows']} rows, {manifest['tokens']} tokens" in line
    # who made it: a copy of the resolved recipe beside the shards, the target's tokenizer
    from transformers import AutoTokenizer

    from specdec.config import load_recipe

    copy = tmp_path / "run" / "teacher-cache" / "recipe.yaml"
    assert load_recipe(copy) == load_recipe(recipe, sets)
    vocab = AutoTokenizer.from_pretrained(files / "target").get_vocab()
    vocab_sha = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    made_by = {
        "recipe": "recipe.yaml",
        "recipe_sha256": hashlib.sha256(copy.read_bytes()).hexdigest(),
        "tokenizer": {"name": str(files / "target"), "vocab_sha256": vocab_sha},
    }
    assert manifest["made_by"] == made_by
    mtimes = [
        p.stat().st_mtime_ns for p in sorted((tmp_path / "run" / "teacher-cache").glob("shard-*"))
    ]
    # nothing to do, for another recipe with the same fingerprint too; who made it stays
    assert main(["data", "cache", "--config", recipe, "--set", *sets, "train.lr=0.5"]) == 0
    again = json.loads((tmp_path / "run" / "teacher-cache" / "manifest.json").read_text())
    assert again["made_by"] == made_by and load_recipe(copy).train.lr != 0.5
    assert mtimes == [
        p.stat().st_mtime_ns for p in sorted((tmp_path / "run" / "teacher-cache").glob("shard-*"))
    ]
    capsys.readouterr()
    assert main(["data", "cache", "--config", recipe, "--set", *sets, "data.cache.dtype=fp8"]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # after the log lines
    assert last.startswith("specdec: error: data.cache.dir: ") and "Traceback" not in err
    assert "another dtype ('float16' there, 'fp8' now)" in last


def test_cache_command_teaches_the_positions_training_does(files, tmp_path):
    """Under ``data.loss_on: all`` the command widens the rows' masks as training does (every
    row's, the held-out ones' too), so training reads the command's cache as it is."""
    from specdec.cli import main
    from specdec.config import load_recipe
    from specdec.training.loop import train

    sets = [*command_sets(files, tmp_path), "data.loss_on=all", "data.teacher=cache"]
    recipe = str(ROOT / "recipes" / "debug" / "tiny_eagle3.yaml")
    assert main(["data", "cache", "--config", recipe, "--set", *sets]) == 0
    cache = tmp_path / "run" / "teacher-cache"
    built = json.loads((cache / "manifest.json").read_text())
    shards = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}
    train(load_recipe(recipe, [*sets, "train.max_steps=1", "train.save_every=1"]))
    assert json.loads((cache / "manifest.json").read_text()) == built
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")} == shards
