"""Draft trees verified in one target forward: greedy exactness on tiny Llama and Qwen targets
(both sessions) with random, perfect and adversarial trees, EOS and max_new_tokens inside a
tree, the walk on hand-made logits, the masks, and the families' tree drafting (the draft
model and EAGLE-3, static and dynamic) checked against their own full forwards."""

from __future__ import annotations

import random

import pytest
import tiny_models
import torch
from test_eagle3 import head

from specdec.decoding import tree
from specdec.decoding.compact import CompactSession
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters import DraftModelDrafter
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.tree import TreeSpec, calibrated_choices, choose_budget, draft_tree
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget

QUESTION = "Tell me about the sea and the sky, the sea and the sky."


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    build = tiny_models.tiny_llama if request.param == "llama" else tiny_models.tiny_qwen2
    model, tokenizer = build()
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": QUESTION}])
    return model, tokenizer, prompt


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by full forwards, no cache: the expected output."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


class RandomTree(Drafter):
    """Random trees (random shape, random tokens); ``truth`` plants the target's greedy
    continuation as one path at random sibling positions (a perfect drafter), ``avoid``
    keeps every node off it (an adversarial one)."""

    name = "random_tree"

    def __init__(self, vocab, full=None, mode="random", width=3, nodes=12, seed=0):
        self.vocab, self.full, self.mode = vocab, full, mode
        self.width, self.nodes = width, nodes
        self.rng = random.Random(seed)

    def propose(self, sequence, k, params, generator=None) -> Proposal:
        rng, parents, tokens = self.rng, [], []
        truth = self.full[len(sequence) : len(sequence) + k] if self.full else []
        depth = {-1: 0}
        on_path = -1  # the deepest planted node so far
        for _ in range(rng.randint(1, self.nodes)):
            parent = rng.choice([u for u in depth if depth[u] < k])
            token = rng.randrange(self.vocab)
            if self.mode == "adversarial" and depth[parent] < len(truth):
                while token == truth[depth[parent]]:
                    token = rng.randrange(self.vocab)
            parents.append(parent)
            tokens.append(token)
            depth[len(tokens) - 1] = depth[parent] + 1
            planted = self.mode == "perfect" and parent == on_path and rng.random() < 0.7
            if planted and depth[parent] < len(truth):
                tokens[-1] = truth[depth[parent]]
                on_path = len(tokens) - 1
        return Proposal(torch.tensor(tokens), None, torch.tensor(parents))


SESSIONS = {"transformers": ModelSession, "compact": CompactSession}


@pytest.mark.parametrize("session", SESSIONS)
@pytest.mark.parametrize("mode", ["random", "perfect", "adversarial"])
def test_greedy_tree_decoding_is_plain_greedy(tiny, session, mode):
    model, _, prompt = tiny
    expected = greedy_reference(model, prompt, 40)
    full = list(prompt) + expected
    vocab = model.config.vocab_size
    accepted = 0
    for k, nodes, seed in [(1, 3, 0), (3, 12, 1), (6, 30, 2), (8, 8, 3)]:
        drafter = RandomTree(vocab, full, mode, nodes=nodes, seed=seed)
        got = generate(SESSIONS[session](model), prompt, drafter=drafter, k=k, max_new_tokens=40)
        assert got.tokens == expected, (mode, k, nodes)
        assert len(got.paths) >= len(got.drafted) - 1  # all but a last round of budget 0: trees
        accepted += sum(got.accepted)
    if mode == "perfect":
        assert accepted > 20  # long paths, deep in the tree, were taken
    if mode == "adversarial":
        assert accepted == 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9])
def test_max_new_tokens_inside_a_tree(tiny, max_new_tokens):
    model, _, prompt = tiny
    expected = greedy_reference(model, prompt, max_new_tokens)
    drafter = RandomTree(model.config.vocab_size, list(prompt) + expected + [0] * 8, "perfect")
    got = generate(ModelSession(model), prompt, drafter=drafter, k=6, max_new_tokens=max_new_tokens)
    assert got.tokens == expected


def test_eos_inside_a_tree_stops_exactly(tiny):
    model, _, prompt = tiny
    free = greedy_reference(model, prompt, 30)
    stop = free[9]
    expected = free[: free.index(stop) + 1]
    drafter = RandomTree(model.config.vocab_size, list(prompt) + free, "perfect", nodes=20)
    got = generate(
        CompactSession(model), prompt, drafter=drafter, k=6, max_new_tokens=30, eos_token_ids=[stop]
    )
    assert got.tokens == expected and got.finished


def test_tree_mask_and_depths_by_hand():
    # root -> 0 -> 2 -> 3 ; root -> 1
    parents = [-1, -1, 0, 2]
    assert tree.depths(parents) == [1, 1, 2, 3]
    assert tree.children(parents) == [[0, 1], [2], [], [3], []]
    mask = tree.tree_mask(parents).int().tolist()
    assert mask == [
        # root n0 n1 n2 n3  (the cache before the root: visible to all)
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    with pytest.raises(ValueError, match="parent 3"):
        tree.depths([-1, 3])


def test_greedy_walk_by_hand():
    """root's argmax 7 is node 1 (not node 0); node 1's argmax 5 is its child node 3; node 3's
    argmax 9 has no child: path [1, 3], emitted 7, 5, 9."""
    tokens = torch.tensor([4, 7, 5, 5])
    parents = [-1, -1, 0, 1]
    logits = torch.full((5, 10), -1.0)
    for row, best in enumerate([7, 5, 5, 9, 2]):  # rows: root, n0, n1, n2, n3
        logits[row, best] = 1.0
    # row 1 + 1 (node 1) predicts 5
    logits[2] = -1.0
    logits[2, 5] = 1.0
    assert tree.verify_tree_greedy(tokens, parents, logits) == ([1, 3], [7, 5, 2])


def test_choose_budget_maximises_tokens_per_second():
    costs = [1.0, 1.0, 1.0, 1.6, 1.6, 3.0]
    # m=2: (1 + .9 + .5) / 1.0 = 2.4; m=4: (2.4 + .4 + .3) / 1.6 = 1.94; m=5: 3.2/3
    assert choose_budget([0.9, 0.5, 0.4, 0.3, 0.1], costs) == 2
    assert choose_budget([0.9, 0.9, 0.9, 0.9, 0.0], costs) == 4  # 4.6 / 1.6 > 2.8
    # a static tree from accepted rank paths: (0,) in 3 of 4 rounds, (0, 0) in 2, (1,) in 1
    paths = [(0, 0), (0, 0, 1), (0,), (1,)]
    assert calibrated_choices(paths, 4, [1.0, 1.0, 1.0, 1.0, 9.0]) == ((0,), (1,), (0, 0))


def test_tree_spec_refuses_a_tree_without_parents():
    with pytest.raises(ValueError, match=r"\[0, 1\] without its parent \[0\]"):
        TreeSpec("static", choices=((1,), (0, 1)))
    with pytest.raises(ValueError, match="budget or measured"):
        TreeSpec("dynamic")


# ------------------------------------------------------------------------ family tree drafting


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(*tiny_models.tiny_llama(), name="tiny-llama")


def family(target, name):
    if name == "draft_model":
        other, _ = tiny_models.tiny_llama(seed=7)
        return DraftModelDrafter(other, target.vocab_size, forward="float32")
    return head(target, draft_vocab_size=96)  # a perturbed head: every weight matters


STATIC = TreeSpec(
    "static", choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0))
)
DYNAMIC = TreeSpec("dynamic", top_k=3, budget=10)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", ["draft_model", "eagle3"])
def test_family_trees_decode_exactly(target, name, spec):
    drafter = family(target, name)
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    expected = greedy_reference(target.model, prompt, 30)
    for session in SESSIONS.values():
        drafter.configure("float32" if name == "draft_model" else "transformers", tree=spec)
        s = session(target.model, hidden_layers=drafter.required_target_layers)
        got = generate(s, prompt, drafter=drafter, k=3, max_new_tokens=30)
        assert got.tokens == expected
        assert max(got.drafted) <= (8 if spec is STATIC else 10)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", ["draft_model", "eagle3"])
def test_tree_nodes_follow_their_own_paths(target, name, spec, monkeypatch):
    """The logits the drafter computes for every fed tree node (in one cached forward per
    depth, under the tree mask) equal its logits after that node's path computed another way:
    the draft model's full forward over sequence + path, EAGLE-3's unrolled training-time
    forward; and each node of a greedy static tree is its parent's rank-r token."""
    drafter = family(target, name)
    module = __import__(type(drafter).__module__, fromlist=["draft_tree"])
    fed = {}  # node -> (path tokens, logits)

    def recording(spec, logits, feed, *args):
        def wrapped(nodes, parents, tokens):
            out = feed(nodes, parents, tokens)
            for r, j in enumerate(nodes):
                fed[j] = (int(tokens[r]), parents, out[r])
            return out

        return draft_tree(spec, logits, wrapped, *args)

    monkeypatch.setattr(module, "draft_tree", recording)
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    drafter.configure("float32" if name == "draft_model" else "transformers", tree=spec)
    session = ModelSession(target.model, hidden_layers=drafter.required_target_layers)
    session.extend(prompt)
    drafter.begin(prompt, session.hidden or None)
    sequence = prompt + [int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())]
    proposal = drafter.propose(sequence, 3, SamplingParams())
    assert len(fed) >= 3
    for j, (_, parents, logits) in fed.items():
        path = [fed[a][0] for a in tree.ancestors(parents, j)]
        torch.testing.assert_close(logits, own_logits(drafter, target, sequence, path))
    if spec is STATIC:
        tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
        ranks = tree.children(parents)
        for j in range(1, len(tokens)):
            parent = parents[j]
            if parent >= 0:
                rank = ranks[1 + parent].index(j)
                best = own_logits(
                    drafter, target, sequence, [tokens[a] for a in tree.ancestors(parents, parent)]
                )
                order = best.topk(rank + 1).indices
                token = order[rank] if drafter.draft_ids is None else drafter.draft_ids[order[rank]]
                assert tokens[j] == int(token)


# a small budget leaves fed nodes out of the proposal: the target's own next token may be one
PRUNED = TreeSpec("dynamic", top_k=3, budget=2)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC, PRUNED], ids=["static", "dynamic", "pruned"])
def test_draft_model_keeps_the_accepted_path_of_its_tree(target, spec, monkeypatch):
    """After a tree round the draft model keeps its cache entries of the accepted path and
    drops the rest: every later tree equals the tree a fresh drafter drafts from scratch on
    the same sequence (a wrong entry kept would change the logits of what follows)."""
    # the target as its own draft: long accepted paths, so kept entries matter
    drafter = DraftModelDrafter(target.model, target.vocab_size, forward="float32")
    fresh = DraftModelDrafter(target.model, target.vocab_size, forward="float32")
    for d in (drafter, fresh):
        d.configure("float32", tree=spec)
    kept = []
    keep = type(drafter.session).keep

    def counting_keep(session, indices):
        if session is drafter.session:
            kept.append(len(indices.tail))  # entries of the tree kept
        return keep(session, indices)

    monkeypatch.setattr(type(drafter.session), "keep", counting_keep)
    propose = drafter.propose

    def checked(sequence, k, params, generator=None):
        got = propose(sequence, k, params, generator)
        fresh.begin(sequence[:1])
        want = fresh.propose(sequence, k, params, generator)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()
        torch.testing.assert_close(drafter.session.ids[: len(sequence)], list(sequence))
        return got

    drafter.propose = checked
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    session = ModelSession(target.model)
    out = generate(session, prompt, drafter=drafter, k=3, max_new_tokens=30)
    assert out.tokens == greedy_reference(target.model, prompt, 30)
    assert len(kept) == len(out.paths) - 1  # every tree round after the first kept a path
    assert sum(kept) > 10  # nodes of accepted paths were kept, not fed again


@torch.no_grad()
def own_logits(drafter, target, sequence, path) -> torch.Tensor:
    """The drafter's logits for the token after ``sequence + path``, by a full forward (draft
    model, target vocabulary) or the unrolled training forward (EAGLE-3, draft vocabulary)."""
    if isinstance(drafter, DraftModelDrafter):
        return drafter.model(torch.tensor([sequence + path])).logits[0, -1]
    model = drafter.module.eval()
    ids = torch.tensor([sequence + path])
    out = target.forward(torch.tensor([sequence]), hidden_layers=drafter.required_target_layers)
    feats = [out.hidden_states[i] for i in drafter.required_target_layers]
    # rows past the sequence have no target features: zeros, never read by the row used
    # below (step s at row t reads features at rows <= t only)
    feats = [torch.cat([f, f.new_zeros(1, len(path), f.shape[-1])], dim=1) for f in feats]
    model.cfg["steps"], steps = len(path) + 1, model.cfg["steps"]
    try:
        unrolled = model(ids, torch.ones_like(ids), feats)  # [S, 1, T, D]
    finally:
        model.cfg["steps"] = steps
    return unrolled[len(path), 0, len(sequence) - 2]  # step s at row t predicts token t + 2 + s


# ----------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("tree_flags", "target_forward"),
    [
        (["--tree", "dynamic", "--tree-top-k", 2], "transformers"),
        (["--tree", "static"], "compact"),  # calibrated on the warm-up prompt
        (["--tree", "static", "--tree-choices", "[[0], [1], [0, 0], [0, 0, 0]]"], "compact"),
    ],
)
def test_scoring_a_perfect_tree(tiny_llama_dir, tmp_path, tree_flags, target_forward):
    """The target as its own draft model: its top tokens are the target's, so the best first
    node is always accepted, and a static tree whose deepest path is the top one is accepted
    to its depth (alpha 1); the score records the tree, its size and the compaction cost."""
    import json

    from specdec.cli import main

    prompts = tmp_path / "prompts.jsonl"
    rows = ["Say hello to the sea.", "Write a loop in Python.", "List three colors."]
    prompts.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    out = tmp_path / "score.json"
    argv = ["score", "--draft-model", tiny_llama_dir, "--target", tiny_llama_dir]
    argv += ["--prompts", prompts, "--num-prompts", 2, "--max-new-tokens", 10, "--k", 3]
    argv += ["--draft-forward", "float32", "--target-forward", target_forward]
    argv += ["--tree-max-nodes", 6, *tree_flags, "--out", out]
    assert main(list(map(str, argv))) == 0
    result = json.loads(out.read_text())
    assert result["greedy_match_rate"] == 1.0
    assert result["accept_rate_per_position"][0] == 1.0  # the best node: the top first token
    assert sum(result["accepted_length_histogram"]) == result["rounds"]
    assert 0 < result["keep_fraction"] < 1
    tree_kind = tree_flags[1]
    assert result["tree"]["kind"] == tree_kind
    if tree_kind == "static":  # every deepest path is the top one: all of it accepted
        assert result["alpha"] == 1.0
        choices = result["tree"]["choices"]
        if "--tree-choices" in tree_flags:
            assert choices == [[0], [1], [0, 0], [0, 0, 0]]
            assert result["accept_rate_per_position"] == [1.0, 1.0, 1.0]
        else:  # only top paths are ever accepted: the calibrated tree is such a chain
            assert choices == [[0], [0, 0], [0, 0, 0]][: len(choices)]
    else:
        assert 0 < result["mean_drafted"] <= 6  # (a last round may have no budget left)


def test_dynamic_tree_stops_expanding_below_its_confidence():
    """Path probabilities by hand: the root's top tokens have q .6 and .3; every node's top
    child has q .5, so the best path of depth d has .6 x .5^(d-1). A depth is expanded (one
    draft forward) only while its best node reaches the confidence: .65 stops at depth 1
    with no forward, .35 after depth 2 (.3), .2 after depth 3 (.15), 0 reaches depth 4."""
    root = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    child = torch.log(torch.tensor([0.5, 0.2, 0.2, 0.1]))
    calls = []

    def feed(nodes, parents, tokens):
        calls.append(len(nodes))
        return child.expand(len(nodes), -1)

    for confidence, forwards, depth in [(0.65, 0, 1), (0.35, 1, 2), (0.2, 2, 3), (0.0, 3, 4)]:
        calls.clear()
        spec = TreeSpec("dynamic", top_k=2, budget=30, confidence=confidence)
        proposal = draft_tree(spec, root, feed, 4, SamplingParams(), None, None, 4)
        assert len(calls) == forwards
        assert max(tree.depths(proposal.parents.tolist())) == depth


def test_static_tree_with_fewer_drawable_children_than_ranks():
    """Sampling with top_k 1 leaves one child per node: the ranks beyond it and their
    subtrees are absent, and the tree is still a valid proposal."""
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])

    def feed(nodes, parents, tokens):
        return logits.expand(len(nodes), -1)

    spec = TreeSpec("static", ((0,), (1,), (1, 0), (1, 0, 0)))
    params = SamplingParams(temperature=1.0, top_k=1)
    proposal = draft_tree(spec, logits, feed, 3, params, torch.Generator(), None, 4)
    assert proposal.tokens.tolist() == [0] and proposal.parents.tolist() == [-1]
    assert proposal.probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
