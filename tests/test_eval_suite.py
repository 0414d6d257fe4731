"""``specdec eval``: every method over the same prompts in one process, the report, the
comparison, and the inputs it refuses. Tiny random models; a draft model of another seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch
from test_cli_errors import error_line

from specdec import drafters
from specdec.scoring import methods as mth
from specdec.scoring import suite
from specdec.scoring.suite import EvalJob, bootstrap_ratio, run_eval
from specdec.scoring.suite_report import compare, write_report
from specdec.target import FrozenTarget

ROWS = [
    {"prompt": "Say hello to the world and repeat hello world.", "task": "chat"},
    {"prompt": "def add(a, b): return a + b. Write add again.", "task": "code"},
    {"prompt": "Count one two three one two three.", "task": "chat"},
    {"prompt": "Write x = x + 1 three times.", "task": "code"},
]
METHODS = ["prompt_lookup", "draft_model:{draft}", "prompt_lookup+draft_model:{draft}"]
HF = ["hf_assisted:{draft}", "hf_prompt_lookup"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("eval")
    tiny_models.save_tiny(*tiny_models.tiny_llama(seed=1), root / "draft")
    (root / "p.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    return root, tiny_llama_dir


def job(files, out: Path, methods=None, **kw) -> EvalJob:
    root, target = files
    specs = [m.format(draft=root / "draft") for m in (methods or METHODS + HF)]
    settings = dict(
        prompts=[str(root / "p.jsonl")], category_column="task", num_prompts=3, warmup=1,
        ks=[1, 2], temperatures=[0.0, 1.0], max_new_tokens=12, target=str(target),
        bootstrap=200,
    )  # fmt: skip
    return EvalJob(methods=specs, out=str(out), **{**settings, **kw})


@pytest.fixture(scope="module")
def results(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    result = run_eval(job(files, out))
    return result, out


def test_every_method_decodes_every_prompt_with_the_order_rotating(files, tmp_path, monkeypatch):
    calls = []
    real_generate, real_hf = suite.generate, suite.mth.run_transformers

    def spy_generate(session, ids, *, drafter=None, **kw):
        calls.append((tuple(ids), drafter.name if drafter else "plain"))
        return real_generate(session, ids, drafter=drafter, **kw)

    def spy_hf(method, model, ids, **kw):
        calls.append((tuple(ids), method.name))
        return real_hf(method, model, ids, **kw)

    monkeypatch.setattr(suite, "generate", spy_generate)
    monkeypatch.setattr(suite.mth, "run_transformers", spy_hf)
    methods = ["prompt_lookup", "hf_prompt_lookup"]
    run_eval(job(files, tmp_path, methods, ks=[2], temperatures=[0.0], num_prompts=3))
    order = ["plain", "generate", "prompt_lookup", "hf_prompt_lookup"]
    prompts = list(dict.fromkeys(ids for ids, _ in calls))
    assert len(prompts) == 4 and len(calls) == 16  # 1 warm-up + 3 prompts, 4 methods each
    for i, ids in enumerate(prompts):
        ran = [name for p, name in calls if p == ids]
        assert ran == order[i % 4 :] + order[: i % 4], f"prompt {i}: {ran}"


def test_speedups_are_ratios_of_the_recorded_totals(results):
    result, _ = results
    for config in result["configs"]:
        plain = config["methods"]["plain"]["per_prompt"]
        base = sum(plain["tokens"]) / sum(plain["seconds"])
        for name, r in config["methods"].items():
            own = r["per_prompt"]
            assert r["speedup"] == pytest.approx(sum(own["tokens"]) / sum(own["seconds"]) / base)
            lo, hi = r["speedup_ci"]
            assert lo <= hi, name
            for cat in ("chat", "code"):
                idx = [i for i, c in enumerate(own["category"]) if c == cat]
                tps = sum(own["tokens"][i] for i in idx) / sum(own["seconds"][i] for i in idx)
                b = sum(plain["tokens"][i] for i in idx) / sum(plain["seconds"][i] for i in idx)
                assert r["per_category"][cat]["speedup"] == pytest.approx(tps / b), (name, cat)


def test_categories_come_from_the_named_column(results):
    result, _ = results
    assert result["prompts"]["categories"] == ["chat", "code"]
    for config in result["configs"]:
        for r in config["methods"].values():
            assert r["per_prompt"]["category"] == ["code", "chat", "code"]  # rows 2-4


def test_greedy_outputs_match_plain_decoding_and_generate(results):
    result, _ = results
    for config in (c for c in result["configs"] if c["temperature"] == 0):
        for name, r in config["methods"].items():
            assert r["greedy_match_rate"] == 1.0, name
            assert r["generate_match_rate"] == 1.0, name
    certs = result["certificates"]
    assert set(certs) == {m for m in result["methods"] if m.startswith("prompt_lookup") or
                          m.startswith("draft_model")}  # fmt: skip
    assert all(c["greedy"]["passed"] and c["greedy"]["identical"] == 3 for c in certs.values())


def test_sampling_runs_report_the_expected_acceptance(results):
    result, _ = results
    for config in result["configs"]:
        r = config["methods"][
            "draft_model:" + str(Path(result["settings"]["prompts"][0]).parent / "draft")
        ]
        if config["temperature"] == 0:
            assert r["expected_alpha"] is None
        else:
            assert 0 < r["expected_alpha"] <= 1
            assert len(r["expected_accept_rate_per_position"]) == config["k"]


def test_report_and_plots_are_written(results):
    result, out = results
    paths = write_report(result, out)
    text = (out / "report.md").read_text()
    for name in result["methods"]:
        assert f"| {name} |" in text
    assert "Per category" in text and "the speed of transformers' `generate()`" in text
    ratio = result["verify_cost_ratio"]
    assert "verify cost v(m)" in text and f"2:{ratio[2]:.2f}" in text
    # the compact target's kernels, as its session chose them on this host
    assert result["target_kernels"].startswith("1")
    assert f"a CPU offers several): {result['target_kernels']}" in text
    # the main table: a header cell for every column, each row's c and v under their names
    config = result["configs"][0]
    lines = text.split(f"## k={config['k']}, T={config['temperature']:g}")[1].splitlines()
    table = [line for line in lines if line.startswith("| ")][: 1 + len(result["methods"])]
    head = [cell.strip() for cell in table[0].strip("|").split("|")]
    for line in table[1:]:
        cells = dict(zip(head, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        r = config["methods"][cells["method"]]
        expected = ("-", "-") if r.get("c") is None else (f"{r['c']:.3f}", f"{r['v']:.2f}")
        assert (cells["c"], cells["v"]) == expected, cells["method"]
    for p in paths[1:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p


def test_bootstrap_interval_of_hand_made_ratios():
    class G:
        def __init__(self, tokens, seconds):
            self.tokens, self.seconds = [0] * tokens, seconds

    rng = np.random.default_rng(0)
    base = [G(10, 1.0), G(20, 4.0), G(30, 2.0)]
    assert bootstrap_ratio(base, base, 500, rng) == [1.0, 1.0]
    twice = [G(10, 0.5), G(20, 2.0), G(30, 1.0)]  # every prompt exactly twice as fast
    assert bootstrap_ratio(twice, base, 500, rng) == pytest.approx([2.0, 2.0])
    mixed = [G(10, 0.25), G(20, 4.0), G(30, 2.0)]  # only the first prompt is faster (4x)
    lo, hi = bootstrap_ratio(mixed, base, 2000, rng)
    # resamples without the first prompt give 1.0; those with only it give 4.0
    assert lo == pytest.approx(1.0) and 1.5 < hi <= 4.0


def test_compare_flags_speedups_whose_intervals_do_not_overlap(results):
    before = json.loads(json.dumps(results[0]))
    assert all(" yes |" in line for line in compare(before, before)[2:])
    r = before["configs"][0]["methods"]["prompt_lookup"]
    r["speedup"], r["speedup_ci"] = 1.0, [0.9, 1.1]
    after = json.loads(json.dumps(before))
    r = after["configs"][0]["methods"]["prompt_lookup"]
    r["speedup"], r["speedup_ci"] = 1.25, [1.1, 1.3]  # touching intervals overlap
    assert not [line for line in compare(before, after) if "NO" in line]
    r["speedup"], r["speedup_ci"] = 1.25, [1.11, 1.3]
    lines = compare(before, after)
    assert [line for line in lines if "NO" in line] == [
        line for line in lines if line.startswith("| k=1, T=0 | prompt_lookup |")
    ]


def test_compare_judges_transformers_methods_against_generate(results):
    """A transformers method's ratio over specdec's plain may move with the machine while its
    ratio over generate() does not: the own-runtime column reads the latter."""
    before = json.loads(json.dumps(results[0]))
    methods = before["configs"][0]["methods"]
    assert methods["hf_prompt_lookup"]["runtime"] == "transformers"
    assert methods["generate"]["runtime"] == "transformers"
    assert methods["plain"]["runtime"] == methods["prompt_lookup"]["runtime"] == "specdec"
    r = methods["hf_prompt_lookup"]
    r["speedup_ci"], r["speedup_vs_generate_ci"] = [0.30, 0.35], [0.9, 1.1]
    after = json.loads(json.dumps(before))
    r = after["configs"][0]["methods"]["hf_prompt_lookup"]
    r["speedup_ci"], r["speedup_vs_generate_ci"] = [0.36, 0.40], [1.0, 1.2]
    row = next(x for x in compare(before, after) if x.startswith("| k=1, T=0 | hf_prompt_lookup"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "NO" and cells[6] == "yes", row
    assert cells[5].startswith(f"{r['speedup_vs_generate']:.2f}x [0.90, 1.10] ->"), row


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the error")

    monkeypatch.setattr("specdec.target.FrozenTarget.load", refuse)


def test_a_method_that_does_not_exist(capsys, files, tmp_path, no_model_loads):
    root, target = files
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "o")]
    err = error_line(capsys, [*argv, "--method", "promt_lookup"])
    assert "method 'promt_lookup': unknown; expected plain, generate, prompt_lookup" in err
    err = error_line(capsys, [*argv, "--method", "hf_assisted:./nowhere"])
    assert "method 'hf_assisted:./nowhere': ./nowhere does not exist" in err
    err = error_line(capsys, [*argv, "--method", "prompt_lookup", "--k", "two"])
    assert "--k two: expected comma-separated ints" in err


def test_a_checkpoint_for_another_target(capsys, files, tmp_path, no_model_loads):
    root, target = files
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "drafter.json").write_text(json.dumps({"family": "draft_model", "target": "other"}))
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "o")]
    err = error_line(capsys, [*argv, "--target", str(target), "--method", str(ckpt)])
    assert f"method '{ckpt}': a checkpoint for target 'other', evaluated against" in err


def test_a_prompt_file_without_the_category_column(capsys, files, tmp_path, no_model_loads):
    root, _ = files
    plain = tmp_path / "plain.jsonl"
    plain.write_text(
        json.dumps({"prompt": "Hi.", "task": "chat"}) + "\n" + json.dumps({"prompt": "Yo."})
    )
    argv = ["eval", "--prompts", str(plain), "--category-column", "task"]
    err = error_line(capsys, [*argv, "--method", "prompt_lookup", "--out", str(tmp_path / "o")])
    assert "plain.jsonl row 2: no 'task' column" in err


def test_earlier_results_are_kept_unless_forced(capsys, files, tmp_path, no_model_loads):
    root, _ = files
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.json").write_text("{}")
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--method", "prompt_lookup"]
    err = error_line(capsys, [*argv, "--out", str(out)])
    assert "holds results.json; pass --force" in err
    (tmp_path / "old.json").write_text("{not json")
    err = error_line(
        capsys, [*argv, "--out", str(tmp_path / "p"), "--compare", str(tmp_path / "old.json")]
    )
    assert f"--compare {tmp_path / 'old.json'}: unreadable" in err


def test_prompts_are_taken_round_robin_over_categories(tmp_path):
    """A pool sorted by category (as MT-bench is) gives every category, each in its order."""
    from specdec.scoring.command import load_prompts

    rows = [{"prompt": f"{task} {i}", "task": task} for task in "abc" for i in range(3)]
    sorted_file = tmp_path / "sorted.jsonl"
    sorted_file.write_text("\n".join(json.dumps(r) for r in rows))
    picked = load_prompts((str(sorted_file),), 5, category_key="task", stratify=True)
    assert [r["category"] for r in picked] == ["a", "b", "c", "a", "b"]
    assert [r["messages"][0]["content"] for r in picked] == ["a 0", "b 0", "c 0", "a 1", "b 1"]
    first = load_prompts((str(sorted_file),), 5, category_key="task")
    assert [r["category"] for r in first] == ["a", "a", "a", "b", "b"]  # score's pick: in order


def test_a_category_of_one_prompt_shows_no_interval():
    from specdec.scoring.suite_report import _ci

    nan = float("nan")
    assert _ci({"speedup": 1.5, "speedup_ci": [nan, nan]}) == "1.50x"
    assert _ci({"speedup": 1.5, "speedup_ci": [1.25, 1.75]}) == "1.50x [1.25, 1.75]"


def test_trees_run_beside_the_chain_in_one_evaluation(files, tmp_path, monkeypatch):
    """``SPEC@dynamic`` and ``SPEC@static`` verify trees in the same run as the chain: each
    greedy output is plain decoding's, the dynamic tree verifies its budget of nodes a round,
    the static one the paths calibrated on the warm-up prompt, and the report names both. The
    target (its head scaled up, so that its law is peaked as a trained model's) drafts for
    itself, so drafts are accepted and trees grow deeper than one token. Verifying costs the
    same at every width here (as on an accelerator): the calibrated tree's size follows the
    accepted paths alone, not this machine's timings (measured, a busy machine's profile had
    two tokens cost so much more than one that the tree shrank to one node)."""
    from specdec.scoring import suite

    monkeypatch.setattr(suite, "cost_profile", lambda s, p, n: {m: 1.0 for m in range(1, n + 1)})
    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    sharp = tiny_models.save_tiny(model, tokenizer, tmp_path / "sharp")
    draft = f"draft_model:{sharp}"
    methods = [draft, draft + "@dynamic", draft + "@static"]
    settings = dict(ks=[2], temperatures=[0.0, 1.0], tree_budget=3, target=str(sharp))
    result = run_eval(job(files, tmp_path / "out", methods, **settings))
    for config in result["configs"]:
        chain, dynamic, static = (config["methods"][m] for m in result["methods"][2:])
        assert "tree" not in chain and dynamic["tree"]["kind"] == "dynamic"
        assert dynamic["tree"]["budget"] == 3 and 1 < dynamic["mean_drafted"] <= 3
        paths = static["tree"]["choices"]
        assert static["tree"]["kind"] == "static" and len(paths) >= 2, paths
        assert 0 < static["mean_drafted"] <= len(paths)
        assert dynamic["tau"] > 1.3 and static["tau"] > 1.3  # drafts accepted
        for tree in (dynamic, static):  # the tree bound: tau over the round's forwards
            cost = tree["mean_depth"] * tree["c"] + tree["v"]
            assert tree["bound_speedup"] == pytest.approx(tree["tau"] / cost)
        if config["temperature"] == 0:
            assert dynamic["greedy_match_rate"] == static["greedy_match_rate"] == 1.0
            assert max(len(p) for p in paths) >= 2 and dynamic["mean_depth"] > 1, paths
    write_report(result, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "Trees verified" in text and "dynamic, top-4, budget 3" in text


def test_a_tree_of_a_method_that_cannot_branch(capsys, files, tmp_path, no_model_loads):
    root, _ = files
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "o")]
    err = error_line(capsys, [*argv, "--method", "hf_prompt_lookup@dynamic"])
    assert "method 'hf_prompt_lookup@dynamic': only a drafter of specdec's decoder" in err
    err = error_line(capsys, [*argv, "--method", "prompt_lookup@dynamic@static"])
    assert "method 'prompt_lookup@dynamic@static': one tree suffix at most" in err
    err = error_line(capsys, [*argv, "--method", "prompt_lookup@static", "--warmup", "0"])
    assert "a static tree is calibrated on the warm-up prompts; set --warmup 1" in err


def test_a_method_s_own_confidence_overrides_the_run_s(files, tmp_path):
    """Drafters tuned to different confidence stops run side by side: ``@confidence=C`` is the
    method's own, the others take ``--draft-confidence``. The draft model is random, so its
    token probabilities are far below 0.5 and a stop of 0.5 ends every chain after the first
    token (which is always drafted); a stop of 0 drafts all k = 3 (fewer in a last round that
    reaches the token limit)."""
    root, _ = files
    draft = f"draft_model:{root / 'draft'}"
    methods = [draft, draft + "@confidence=0", draft + "@confidence=0.5@static"]
    settings = dict(ks=[3], temperatures=[0.0], draft_confidence=0.5, tree_budget=3)
    result = run_eval(job(files, tmp_path, methods, **settings))
    by_run, own_zero, own_tree = (result["configs"][0]["methods"][m] for m in result["methods"][2:])
    assert by_run["draft_confidence"] == 0.5 and 0.8 < by_run["mean_drafted"] <= 1.0
    assert own_zero["draft_confidence"] == 0.0 and own_zero["mean_drafted"] > 2
    assert own_tree["draft_confidence"] == 0.5 and own_tree["tree"]["kind"] == "static"
    for r in (by_run, own_zero, own_tree):
        assert r["greedy_match_rate"] == 1.0


def test_confidence_suffixes_it_refuses(capsys, files, tmp_path, no_model_loads):
    root, _ = files
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "o")]
    for method, message in (
        ("prompt_lookup@confidence=1", "prompt_lookup@confidence=1': confidence=1: expected a "
         "number in [0, 1)"),
        ("prompt_lookup@confidence=high", "confidence=high: expected a number in [0, 1)"),
        ("prompt_lookup@confidence=0.1@confidence=0.2", "one confidence suffix at most"),
        ("hf_prompt_lookup@confidence=0.3", "only a drafter of specdec's decoder takes a draft "
         "confidence, not 'hf_prompt_lookup'"),
    ):  # fmt: skip
        assert message in error_line(capsys, [*argv, "--method", method]), method


def test_min_ngram_suffixes_it_refuses(capsys, files, tmp_path, no_model_loads):
    """``@min_ngram=N`` is prompt lookup's, alone or in a hybrid: refused elsewhere, below 1,
    twice, or above the longest n-gram prompt lookup tries (3 unless --max-ngram), before any
    model loads."""
    root, _ = files
    argv = ["eval", "--prompts", str(root / "p.jsonl"), "--out", str(tmp_path / "o")]
    draft = f"draft_model:{root / 'draft'}"
    for method, extra, message in (
        ("prompt_lookup@min_ngram=0", [], "min_ngram=0: expected an integer >= 1"),
        ("prompt_lookup@min_ngram=two", [], "min_ngram=two: expected an integer >= 1"),
        ("prompt_lookup@min_ngram=2@min_ngram=3", [], "one min_ngram suffix at most"),
        (f"{draft}@min_ngram=2", [], "sets prompt lookup's, alone or in front of a drafter"),
        ("hf_prompt_lookup@min_ngram=2", [], "only a drafter of specdec's decoder takes a "
         "prompt lookup setting, not 'hf_prompt_lookup'"),
        (f"prompt_lookup+{draft}@min_ngram=4", [], "min_ngram=4 is longer than prompt "
         "lookup's longest n-gram (3); raise --max-ngram"),
        ("prompt_lookup@min_ngram=3", ["--max-ngram", "2"], "longest n-gram (2)"),
        ("prompt_lookup@copy_start=-1", [], "copy_start=-1: expected an integer >= 0"),
        ("prompt_lookup@copy_start=2@copy_start=4", [], "one copy_start suffix at most"),
        (f"{draft}@copy_start=8", [], "@copy_start=N sets prompt lookup's"),
    ):  # fmt: skip
        assert message in error_line(capsys, [*argv, *extra, "--method", method]), method


def loaded(files, alone: str, hybrid: str):
    """The methods ``alone`` and ``hybrid`` (its ``{hybrid}``: prompt lookup in front of the
    test's draft model) and that hybrid without suffixes, loaded, and the target."""
    root, target_dir = files
    target = FrozenTarget.load(str(target_dir))
    plain_hybrid = f"prompt_lookup+draft_model:{root / 'draft'}"
    specs = (alone, hybrid.format(hybrid=plain_hybrid), plain_hybrid)
    methods = [mth.parse(spec) for spec in specs]
    for method in methods:
        mth.load(method, target)
    return (*methods, target)


def test_min_ngram_reaches_prompt_lookup(files):
    """The suffix sets prompt lookup's shortest match, alone and in a hybrid, with the other
    suffixes beside it; without it a hybrid trusts matches from HYBRID_MIN_NGRAM tokens."""
    alone, hybrid, default, target = loaded(
        files, "prompt_lookup@min_ngram=2@confidence=0.5", "{hybrid}@min_ngram=3@confidence=0.3"
    )
    assert (alone.min_ngram, alone.confidence, alone.drafter.min_ngram) == (2, 0.5, 2)
    assert (hybrid.confidence, hybrid.drafter.lookup.min_ngram) == (0.3, 3)
    assert default.min_ngram is None
    assert default.drafter.lookup.min_ngram == drafters.HYBRID_MIN_NGRAM
    longer = mth.parse(default.name)
    mth.load(longer, target, max_ngram=1)  # the default capped by a shorter longest n-gram
    assert (longer.drafter.lookup.min_ngram, longer.drafter.lookup.max_ngram) == (1, 1)


def test_copy_start_reaches_prompt_lookup(files):
    """``@copy_start=N`` sets prompt lookup's first copy length, alone and in a hybrid, beside
    the other suffixes (0: always k); without it the config's default, 4."""
    alone, hybrid, default, _ = loaded(
        files, "prompt_lookup@copy_start=0", "{hybrid}@min_ngram=2@copy_start=8@confidence=0.3"
    )
    assert (alone.copy_start, alone.drafter.copy_start, alone.drafter.limit(12)) == (0, 0, 12)
    lookup = hybrid.drafter.lookup
    assert (lookup.copy_start, lookup.min_ngram, hybrid.confidence) == (8, 2, 0.3)
    assert default.copy_start is None and default.drafter.lookup.limit(12) == 4


def test_a_chain_only_family_asked_for_a_tree(files, tmp_path):
    with pytest.raises(suite.ConfigError, match="'prompt_lookup' drafter drafts chains only"):
        run_eval(job(files, tmp_path, ["prompt_lookup@dynamic"], ks=[2], temperatures=[0.0]))
