"""Target regeneration: exact greedy outputs under left padding and in the compact backend's
slots, resumable sharded output."""

import json
import logging

import pytest
import torch

from specdec.data import regenerate as regen
from specdec.data.compact_backend import CompactGenerator
from specdec.data.regenerate import load_regenerated, regenerate
from specdec.errors import DataError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "drafts"]


def make_prompts(n: int = 10) -> list[dict]:
    """Prompts of varied length, some with a system turn, some with a category."""
    prompts = []
    for i in range(n):
        text = " ".join(WORDS[(i * j) % len(WORDS)] for j in range(1 + (i * 7) % 13))
        messages = [{"role": "user", "content": f"{i}: {text}"}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        prompts.append({"id": f"p{i}", "messages": messages, "category": ["chat", None][i % 2]})
    return prompts


def prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def sharpen(model, std: float = 0.3):
    """Redraw the matrices with a larger std, in float64. At the default init a 2-layer model
    barely looks past the last token, which would hide padding bugs; float64 rules out
    near-ties between greedy candidates."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model.double()


def reference(model, tokenizer, prompt: dict, max_new_tokens: int) -> tuple[list[int], bool]:
    """New token ids (cut after the first EOS) of one prompt alone, unpadded, through plain
    greedy ``generate``, and whether EOS ended them."""
    ids = torch.tensor([prompt_ids(tokenizer, prompt["messages"])])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    new = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        return new[: new.index(tokenizer.eos_token_id) + 1], True
    return new, False


def make_eos_reachable(model, tokenizer, prompt: dict) -> None:
    """Swap the output rows of EOS and the token greedy emits third for ``prompt``, so that at
    least that prompt ends with EOS (the random model would otherwise rarely produce it)."""
    ids = torch.tensor([prompt_ids(tokenizer, prompt["messages"])])
    third = model.generate(ids, do_sample=False, max_new_tokens=3)[0, -1].item()
    weight = model.get_output_embeddings().weight
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        weight[[third, eos]] = weight[[eos, third]].clone()


def run(model, tokenizer, prompts, out_dir, **kwargs) -> regen.RegenerateStats:
    settings = {"max_new_tokens": 8, "batch_size": 3, "shard_size": 4, "progress": False}
    return regenerate(model, tokenizer, prompts, out_dir, **{**settings, **kwargs})


BACKENDS = ["transformers", "compact"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_unpadded_generate(tiny_model, tmp_path, backend):
    model, tokenizer = tiny_model
    sharpen(model)
    prompts = make_prompts(10)
    if not model.config.tie_word_embeddings:
        make_eos_reachable(model, tokenizer, prompts[4])
    expected = [reference(model, tokenizer, p, 12) for p in prompts]

    stats = run(model, tokenizer, prompts, tmp_path, max_new_tokens=12, batch_size=4,
                backend=backend)  # fmt: skip
    rows = load_regenerated(tmp_path).to_list()
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]
    for (ids, finished), row in zip(expected, rows, strict=True):
        text = tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=True)
        assert row["messages"][-1] == {"role": "assistant", "content": text}, row["id"]
        assert (row["num_new_tokens"], row["finished"]) == (len(ids), finished), row["id"]
    assert stats.truncated == sum(not finished for _, finished in expected)
    assert stats.new_tokens == sum(len(ids) for ids, _ in expected)
    if not model.config.tie_word_embeddings:
        assert 0 < stats.truncated < len(prompts)  # both kinds of row were exercised

    # token for token, with every prompt in one batch: the most padding there can be, or
    # (compact) three slots that start again as each answer ends
    batch = [
        regen._Prompt(i, p["id"], p["messages"], None, prompt_ids(tokenizer, p["messages"]))
        for i, p in enumerate(prompts)
    ]
    params, eos = regen.SamplingParams(), [tokenizer.eos_token_id]
    if backend == "compact":
        generate = CompactGenerator(model, params, 0, eos, 12, slots=3)
    else:
        generate = regen.BatchGenerator(model, params, 0, eos, None, 12)
    assert generate(batch) == expected


def test_rows_fields_and_prompt_order(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    prompts = make_prompts(9)
    stats = run(model, tokenizer, prompts, tmp_path)
    assert (stats.num_prompts, stats.num_done, stats.num_skipped, stats.num_shards) == (9, 9, 0, 3)
    ds = load_regenerated(tmp_path)
    assert ds.column_names == ["id", "messages", "category", "num_new_tokens", "finished"]
    for prompt, row in zip(prompts, ds.to_list(), strict=True):
        assert row["id"] == prompt["id"] and row["category"] == prompt["category"]
        assert row["messages"][:-1] == prompt["messages"]
        assert row["messages"][-1]["role"] == "assistant"
        assert row["num_new_tokens"] == 8 and row["finished"] is False
    # shards hold the processing order: longest prompt first
    lengths = {p["id"]: len(prompt_ids(tokenizer, p["messages"])) for p in prompts}
    first = [json.loads(line)["id"] for line in (tmp_path / "shard-00000.jsonl").open()]
    assert lengths[first[0]] == max(lengths.values())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["settings"]["max_new_tokens"] == 8
    assert manifest["counts"]["num_rows"] == 9 and manifest["counts"]["complete"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_is_per_prompt_whatever_the_batching(tiny_llama, tmp_path, backend):
    model, tokenizer = tiny_llama
    sharpen(model)
    prompts = make_prompts(8)
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 3}
    run(model, tokenizer, prompts, tmp_path / "a", batch_size=1, sort_by_length=False, **sampling)
    batched = {"batch_size": 4, "backend": backend, **sampling}
    run(model, tokenizer, prompts, tmp_path / "b", **batched)
    run(model, tokenizer, prompts, tmp_path / "c", **{**batched, "seed": 4})
    run(model, tokenizer, prompts, tmp_path / "d", **{**batched, "batch_size": 1})
    a, b, c, d = (load_regenerated(tmp_path / x).to_list() for x in "abcd")
    # the compact backend draws from the same per-prompt streams as generate
    assert a == b == d
    assert a != c


def crash_after_shards(monkeypatch, num_shards: int) -> None:
    """Make shard writes die after ``num_shards`` like a SIGKILL would: no flush, a stray
    temp file left behind."""
    write = regen._write_atomic
    written = []

    def dying_write(path, text):
        if path.name.startswith("shard-"):
            if len(written) == num_shards:
                path.with_name(path.name + ".tmp").write_text(text[: len(text) // 2])
                raise RuntimeError("killed")
            written.append(path)
        write(path, text)

    monkeypatch.setattr(regen, "_write_atomic", dying_write)


def test_resume_after_kill_equals_uninterrupted_run(tiny_llama, tmp_path, monkeypatch):
    model, tokenizer = tiny_llama
    prompts = make_prompts(11)
    run(model, tokenizer, prompts, tmp_path / "whole")

    with monkeypatch.context() as patch:
        crash_after_shards(patch, 2)
        with pytest.raises(RuntimeError, match="killed"):
            run(model, tokenizer, prompts, tmp_path / "resumed")
    assert len(list((tmp_path / "resumed").glob("shard-*.jsonl"))) == 2
    assert len(load_regenerated(tmp_path / "resumed")) == 8

    stats = run(model, tokenizer, prompts, tmp_path / "resumed")
    assert (stats.num_skipped, stats.num_done) == (8, 3)
    assert not list((tmp_path / "resumed").glob("*.tmp"))
    resumed = load_regenerated(tmp_path / "resumed").to_list()
    assert [r["id"] for r in resumed] == [p["id"] for p in prompts]
    assert resumed == load_regenerated(tmp_path / "whole").to_list()

    again = run(model, tokenizer, prompts, tmp_path / "resumed")
    assert (again.num_skipped, again.num_done, again.new_tokens) == (11, 0, 0)


def test_ctrl_c_keeps_generated_rows(tiny_llama, tmp_path, monkeypatch):
    model, tokenizer = tiny_llama
    prompts = make_prompts(10)
    call = regen.BatchGenerator.__call__
    calls = []

    def interrupted(self, batch):
        calls.append(batch)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return call(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(regen.BatchGenerator, "__call__", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run(model, tokenizer, prompts, tmp_path, batch_size=2, shard_size=100)
    assert len(load_regenerated(tmp_path)) == 4  # two batches, flushed as one short shard
    stats = run(model, tokenizer, prompts, tmp_path, batch_size=2, shard_size=100)
    assert (stats.num_skipped, stats.num_done, stats.num_shards) == (4, 6, 2)
    assert sorted(load_regenerated(tmp_path)["id"]) == sorted(p["id"] for p in prompts)


def test_different_settings_in_out_dir_are_an_error(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    prompts = make_prompts(4)
    run(model, tokenizer, prompts, tmp_path, max_new_tokens=4)
    with pytest.raises(DataError, match="max_new_tokens=4 there, 5 now"):
        run(model, tokenizer, prompts, tmp_path, max_new_tokens=5)
    with pytest.raises(DataError, match="temperature"):
        run(model, tokenizer, prompts, tmp_path, max_new_tokens=4, temperature=0.7)
    with pytest.raises(DataError, match="different prompt set"):
        run(model, tokenizer, prompts[:3], tmp_path, max_new_tokens=4)
    # another backend's kernels may break ties differently: not mixed in one directory
    with pytest.raises(DataError, match="backend=None there, 'compact' now"):
        run(model, tokenizer, prompts, tmp_path, max_new_tokens=4, backend="compact")
    # batching does not change what is generated, so it may change between calls
    stats = run(model, tokenizer, prompts, tmp_path, max_new_tokens=4, batch_size=1)
    assert stats.num_skipped == 4


def test_malformed_prompts_are_errors(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    prompts = make_prompts(3)
    with pytest.raises(DataError, match="'p1' appears more than once"):
        run(model, tokenizer, [*prompts, dict(prompts[1])], tmp_path)
    with pytest.raises(DataError, match="prompt 0 has no string 'id'"):
        run(model, tokenizer, [{"messages": prompts[0]["messages"]}], tmp_path)
    ends_answered = [*prompts[0]["messages"], {"role": "assistant", "content": "hi"}]
    with pytest.raises(DataError, match="'x' ends with an assistant turn"):
        run(model, tokenizer, [{"id": "x", "messages": ends_answered}], tmp_path)
    with pytest.raises(DataError, match="holds no regeneration"):
        load_regenerated(tmp_path / "missing")


def test_too_long_prompts_are_left_out_and_counted(tiny_llama, tmp_path, caplog):
    model, tokenizer = tiny_llama
    prompts = make_prompts(8)
    lengths = sorted(len(prompt_ids(tokenizer, p["messages"])) for p in prompts)
    limit = lengths[5]
    expected = sum(n > limit for n in lengths)
    with caplog.at_level(logging.WARNING, logger="specdec.data.regenerate"):
        stats = run(model, tokenizer, prompts, tmp_path, max_prompt_length=limit)
    assert stats.num_too_long == expected > 0
    assert f"left out {expected} of 8 prompts" in caplog.text
    assert len(load_regenerated(tmp_path)) == 8 - expected


def test_token_budget_batches_grow_for_short_prompts(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    prompts = [
        regen._Prompt(i, f"p{i}", [], None, [0] * n) for i, n in enumerate([9, 8, 3, 3, 2, 2])
    ]
    sizes = [len(b) for b in regen._batches(prompts, size=4, budget=25, max_new=1)]
    assert sizes == [2, 4]  # 2 x (9 + 1) fits 25, 3 x 10 does not; then 4 x (3 + 1) does
    whole = run(model, tokenizer, make_prompts(8), tmp_path / "a", batch_size=8)
    budget = run(model, tokenizer, make_prompts(8), tmp_path / "b", max_batch_tokens=120)
    assert whole.new_tokens == budget.new_tokens
    assert load_regenerated(tmp_path / "a").to_list() == load_regenerated(tmp_path / "b").to_list()


def test_prompt_the_chat_template_refuses_is_named(tiny_qwen2, tmp_path):
    model, tokenizer = tiny_qwen2  # its template requires alternating user/assistant turns
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(DataError, match="prompt 'x': the chat template refused it"):
        run(model, tokenizer, [{"id": "x", "messages": twice}], tmp_path)


def fresh_then_first(model, tokenizer, tmp_path, first, grown) -> list[dict]:
    """Runs ``grown`` into ``fresh`` and ``first`` into ``grown``; the fresh rows."""
    run(model, tokenizer, grown, tmp_path / "fresh")
    run(model, tokenizer, first, tmp_path / "grown")
    return load_regenerated(tmp_path / "fresh").to_list()


@pytest.mark.parametrize("where", ["at the end", "in between", "all in another order"])
def test_prompt_set_grows_and_equals_a_fresh_run(tiny_llama, tmp_path, where):
    model, tokenizer = tiny_llama
    prompts = make_prompts(11)
    if where == "at the end":
        first = prompts[:7]
    elif where == "in between":
        first = [p for i, p in enumerate(prompts) if i not in (0, 4, 5, 9)]
    else:  # a recipe's prompts are shuffled: a new source reorders the earlier ones too
        first = [prompts[i] for i in (6, 2, 8, 0, 10, 3, 5)]
    fresh = fresh_then_first(model, tokenizer, tmp_path, first, prompts)
    stats = run(model, tokenizer, prompts, tmp_path / "grown")
    assert (stats.num_skipped, stats.num_done) == (7, 4)
    assert load_regenerated(tmp_path / "grown").to_list() == fresh
    manifest = json.loads((tmp_path / "grown" / "manifest.json").read_text())
    expected = json.loads((tmp_path / "fresh" / "manifest.json").read_text())
    assert manifest["settings"] == expected["settings"]
    assert manifest["counts"] == expected["counts"] | {
        "num_shards": manifest["counts"]["num_shards"]
    }


@pytest.mark.parametrize("change", ["grown", "only reordered"])
def test_killed_while_renumbering_finishes_when_resumed(tiny_llama, tmp_path, monkeypatch, change):
    model, tokenizer = tiny_llama
    prompts = make_prompts(11)
    # every kept row moves: three new prompts come first / the same prompts reversed
    first = prompts[3:] if change == "grown" else prompts[::-1]
    fresh = fresh_then_first(model, tokenizer, tmp_path, first, prompts)
    with monkeypatch.context() as patch:
        crash_after_shards(patch, 1)  # one shard renumbered, then killed
        with pytest.raises(RuntimeError, match="killed"):
            run(model, tokenizer, prompts, tmp_path / "grown")
    manifest = json.loads((tmp_path / "grown" / "manifest.json").read_text())
    assert not manifest["counts"]["complete"]  # the mixed rows are not read back as finished
    stats = run(model, tokenizer, prompts, tmp_path / "grown")
    new = 3 if change == "grown" else 0
    assert (stats.num_skipped, stats.num_done) == (11 - new, new)
    assert load_regenerated(tmp_path / "grown").to_list() == fresh


@pytest.mark.parametrize(
    "change", ["answered prompt reworded", "answered prompt gone", "grown before it was complete"]
)
def test_prompt_set_that_does_not_only_grow_is_refused(tiny_llama, tmp_path, monkeypatch, change):
    model, tokenizer = tiny_llama
    prompts = make_prompts(8)
    if change == "grown before it was complete":
        with monkeypatch.context() as patch:
            crash_after_shards(patch, 1)
            with pytest.raises(RuntimeError, match="killed"):
                run(model, tokenizer, prompts[:5], tmp_path)
    else:
        run(model, tokenizer, prompts[:5], tmp_path)
    before = load_regenerated(tmp_path).to_list()
    if change == "answered prompt reworded":
        reworded = {**prompts[2], "messages": [{"role": "user", "content": "something else"}]}
        changed = [*prompts[:2], reworded, *prompts[3:]]
    elif change == "answered prompt gone":
        changed = [*prompts[:2], *prompts[3:]]
    else:
        changed = prompts
    with pytest.raises(DataError, match="different prompt set"):
        run(model, tokenizer, changed, tmp_path)
    assert load_regenerated(tmp_path).to_list() == before  # nothing written
