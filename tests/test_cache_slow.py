"""The teacher cache on the real SmolLM2 target: the full float32 cache reads back the target's
own forward; a top-64 fp8 cache keeps its top token and stays within its total-variation
bound."""

from types import SimpleNamespace

import pytest
import torch

from specdec.data.cache import build_cache, fingerprint
from specdec.data.cache_read import TeacherCache
from specdec.data.chat import build_sft_dataset
from specdec.target import FrozenTarget

pytestmark = pytest.mark.slow

LAYERS = (1, 14, 26)
CHATS = [
    (
        "Write a haiku about the sea.",
        "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
    ),
    ("def add(a, b):", "    return a + b"),
    ("Name three primary colors.", "Red, yellow and blue."),
]


@pytest.fixture(scope="module")
def setup():
    target = FrozenTarget.load("smollm2-135m-instruct", device="cpu")
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in CHATS
    ]
    dataset, _ = build_sft_dataset(rows, target.tokenizer, 256)
    return target, dataset


def cached(target, dataset, out, top_k, dtype) -> TeacherCache:
    cfg = SimpleNamespace(top_k=top_k, dtype=dtype, shard_rows=2, batch_size=2)
    fp = fingerprint(target, SimpleNamespace(dtype="float32"), dataset, LAYERS, cfg)
    build_cache(target, dataset, fp, out, cfg.batch_size, progress=False)
    return TeacherCache(out, fp)


def test_smollm2_cache_reads_back_its_forward(setup, tmp_path):
    target, dataset = setup
    full = cached(target, dataset, tmp_path / "full", 0, "float32")
    lossy = cached(target, dataset, tmp_path / "lossy", 64, "fp8")
    for i in range(len(dataset)):
        ids, mask = dataset[i]["input_ids"], dataset[i]["loss_mask"]
        where = [t for t in range(len(ids) - 1) if mask[t + 1]]
        with torch.no_grad():
            out = target.model(torch.tensor([ids]), output_hidden_states=True)
        log_p = torch.log_softmax(out.logits[0].float(), -1)[where]
        hidden = torch.stack([out.hidden_states[h + 1][0] for h in LAYERS], 1)
        row = full.row(i)
        torch.testing.assert_close(row["log_p"], log_p, atol=2e-4, rtol=0)
        torch.testing.assert_close(row["features"], hidden, atol=2e-4, rtol=1e-4)
        approx = lossy.row(i)["log_p"]
        # its top token is the target's but where fp8 rounding meets a near-tie
        assert (approx.argmax(-1) == log_p.argmax(-1)).float().mean() >= 0.98
        # total variation: the tail contributes at most its mass (both sides spread it), the
        # top 64 at most fp8's relative error on each log-probability (2^-4, times e^(2^-4 |log p|)
        # < 1.1 while p > e^-1.5, the values that weigh)
        p = log_p.exp()
        top = log_p.topk(64, -1)
        rest = 1 - top.values.exp().sum(-1)
        entropy_top = -(top.values.exp() * top.values).sum(-1)
        tv = (p - approx.exp()).abs().sum(-1) / 2
        assert (tv <= rest + 0.55 * entropy_top / 16 + 1e-3).all(), (tv, rest)
