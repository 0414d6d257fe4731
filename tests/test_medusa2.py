"""Medusa-2: Medusa heads trained with LoRA adapters on the backbone (peft). The target is never
changed (it stays the teacher); the adapted backbone starts as the target, verifies the
proposals, and its distance to the target is reported. Tiny random Llama target."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import teachers
import tiny_models
import torch
from safetensors.torch import load_file
from test_cli_errors import error_line
from test_eagle3_training import overrides
from test_medusa import DYNAMIC, QUESTION, last_hidden
from test_training import launch, setup
from test_tree import greedy_reference

from specdec import drafters
from specdec.config import load_recipe
from specdec.decoding.compact import CompactSession
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.drafters.medusa import MedusaConfig
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug" / "tiny_medusa2.yaml"
files = setup  # the tiny target and prompt files of the draft-model training tests


@pytest.fixture()
def target():
    return FrozenTarget(*tiny_models.tiny_llama(), name="tiny-llama")


def medusa2(target, seed: int = 0, adapter_scale: float = 0.0, **cfg):
    torch.manual_seed(seed)
    drafter = drafters.build(target, MedusaConfig(lora_rank=4, num_heads=3, **cfg))
    with torch.no_grad():  # B starts at zero (the adapted backbone is the target): move it
        for name, p in drafter.backbone.named_parameters():
            if "lora_B" in name:
                p.add_(adapter_scale * torch.randn_like(p))
    return drafter


def test_fresh_adapted_backbone_is_the_target_and_shares_its_weights(target):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter = medusa2(target)
    ids = torch.randint(0, target.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = target.model(ids).logits
        steps = drafter.module(ids, None)
    assert steps.shape == (4, 2, 7, target.vocab_size)  # the backbone's step and 3 heads
    for s in range(4):  # fresh heads are the read-out too
        torch.testing.assert_close(steps[s], want, atol=1e-5, rtol=1e-5)
    attention = target.model.model.layers[0].self_attn
    assert type(attention.q_proj) is torch.nn.Linear  # the target's modules are not wrapped
    copy = drafter.backbone.base_model.model.model.layers[0].self_attn
    assert copy.q_proj.base_layer.weight.data_ptr() == attention.q_proj.weight.data_ptr()
    trainable = {n for n, p in drafter.module.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("heads.", "adapters.")) for n in trainable)
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_teacher_and_weights_put_the_backbone_first(target):
    drafter = medusa2(target, backbone_weight=0.3)
    logits = torch.randn(1, 8, target.vocab_size, generator=torch.Generator().manual_seed(1))
    teacher = drafter.teacher(logits, torch.ones(1, 8))
    log_p = torch.log_softmax(logits, -1)
    for s in range(4):  # step 0: the next token (row t); head s - 1: the token t + 1 + s
        log_p_s = teachers.grid(teacher, s)[0]
        torch.testing.assert_close(log_p_s[0, : 8 - 1 - s], log_p[0, s:7])
        assert teacher.mask[s, 0].tolist() == [True] * (8 - 1 - s) + [False] * (1 + s)
    assert drafter.step_weights().tolist() == pytest.approx([0.3, 1.0, 0.8, 0.64])


def test_heads_over_a_reduced_vocabulary_keep_the_backbone_step_full(target):
    """With ``draft_vocab_size`` the heads read out over D tokens; the backbone's own step
    stays over the full vocabulary, and so does its teacher."""
    counts = torch.arange(
        target.vocab_size, 0, -1
    ).float()  # the D lowest ids are the most frequent
    torch.manual_seed(0)
    drafter = drafters.build(
        target, MedusaConfig(lora_rank=4, num_heads=3, draft_vocab_size=50), counts
    )
    assert torch.equal(drafter.draft_ids.sort().values, torch.arange(50))
    ids = torch.randint(0, target.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        steps = drafter.module(ids, None)
        want = target.model(ids).logits
    assert [tuple(t.shape) for t in steps] == [(2, 8, target.vocab_size)] + [(2, 8, 50)] * 3
    torch.testing.assert_close(steps[0], want, atol=1e-5, rtol=1e-5)  # fresh adapters
    for head in steps[1:]:  # fresh heads: the target's rows of the draft tokens
        torch.testing.assert_close(head, want[..., drafter.draft_ids], atol=1e-5, rtol=1e-5)
    logits = torch.randn(1, 8, target.vocab_size, generator=torch.Generator().manual_seed(1))
    teacher = drafter.teacher(logits, torch.ones(1, 8))
    log_p = torch.log_softmax(logits, -1)
    step_p, step_t = teachers.grid(teacher, 0)
    torch.testing.assert_close(step_p[0, :7], log_p[0, :7])
    assert torch.equal(step_t[0, :7], log_p[0, :7].argmax(-1))
    for s in range(1, 4):
        step_p, step_t = teachers.grid(teacher, s)
        torch.testing.assert_close(step_p[0, : 8 - 1 - s], log_p[0, s:7, :50])
        best = log_p[0, s:7].argmax(-1)
        assert torch.equal(step_t[0, : 8 - 1 - s], torch.where(best < 50, best, -1))
    # a teacher cache is read over teacher_vocab: here the full vocabulary, for step 0
    assert drafter.teacher_vocab is None
    cached = drafter.shifted_teacher(log_p, log_p.argmax(-1), torch.ones(1, 8))
    for s in range(4):
        for read, computed in zip(cached.at(s), teacher.at(s), strict=True):
            assert torch.equal(read, computed)


def test_verifier_is_the_adapted_backbone_and_decoding_is_its_greedy_output(target):
    drafter = medusa2(target, adapter_scale=0.5)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    verifier = drafter.verifier(target.model)
    ids = torch.randint(0, target.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted = drafter.backbone(input_ids=ids).logits
        torch.testing.assert_close(verifier(ids).logits, adapted, atol=1e-5, rtol=1e-5)
        assert (adapted - target.model(ids).logits).abs().max() > 1e-2  # it is adapted
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, before[k]), f"target {k} changed by merging"
    prompt = encode_prompt(target.tokenizer, [{"role": "user", "content": QUESTION}])
    expected = greedy_reference(verifier, prompt, 30)
    assert expected != greedy_reference(target.model, prompt, 30)
    # heads fitted to the verifier's own continuation, so drafts are accepted too
    h = last_hidden(FrozenTarget(verifier, target.tokenizer, name="v"), prompt + expected)[None]
    labels = torch.tensor(prompt + expected)
    optimizer = torch.optim.Adam(drafter.model.parameters(), lr=1e-2)
    for _ in range(100):
        logits = drafter.model(None, None, [h])
        loss = sum(
            torch.nn.functional.cross_entropy(logits[s, 0, : -2 - s], labels[2 + s :])
            for s in range(3)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.configure()
    for session in (ModelSession, CompactSession):
        s = session(verifier, hidden_layers=drafter.required_target_layers)
        got = generate(s, prompt, drafter=drafter, k=3, max_new_tokens=30)
        assert got.tokens == expected and sum(got.accepted) > 0
    # k above the heads: as deep as there are heads (the backbone's step drafts none)
    for tree in (None, DYNAMIC):
        drafter.configure(tree=tree)
        s = CompactSession(verifier, hidden_layers=drafter.required_target_layers)
        got = generate(s, prompt, drafter=drafter, k=6, max_new_tokens=30)
        assert got.tokens == expected and max(got.depths) == 3


def test_sampling_passes_the_certificate_with_heads_over_a_reduced_vocabulary():
    """T = 1 on a peaked tiny target: the output's law is the adapted backbone's (the
    verifier), with heads over 300 of the 384 tokens fitted to its continuations."""
    from specdec.scoring.certificate import sampling_certificate

    model, tokenizer = tiny_models.tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    sharp = FrozenTarget(model, tokenizer, name="tiny-sharp")
    counts = torch.arange(sharp.vocab_size, 0, -1).float()
    torch.manual_seed(0)
    drafter = drafters.build(
        sharp, MedusaConfig(lora_rank=4, num_heads=3, draft_vocab_size=300), counts
    )
    with torch.no_grad():
        for name, p in drafter.backbone.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    verifier = drafter.verifier(sharp.model)
    prompts = [tokenizer(t)["input_ids"] for t in ("The quick brown fox", "def add(a, b):")]
    optimizer = torch.optim.Adam(drafter.model.parameters(), lr=1e-2)
    texts = [p + greedy_reference(verifier, p, 12) for p in prompts]
    hidden = [last_hidden(FrozenTarget(verifier, tokenizer, name="v"), t)[None] for t in texts]
    ids = drafter.draft_ids.tolist()
    for _ in range(100):
        loss = 0.0
        for text, h in zip(texts, hidden, strict=True):
            logits = drafter.model(None, None, [h])
            for s in range(3):
                labels = torch.tensor([ids.index(t) if t in ids else -100 for t in text[2 + s :]])
                loss = loss + torch.nn.functional.cross_entropy(
                    logits[s, 0, : len(labels)], labels, ignore_index=-100
                )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.configure()
    result = sampling_certificate(verifier, None, drafter, prompts, 6_000, k=3, new_tokens=3)
    assert result["passed"] and result["p_value"] > 1e-3, result
    assert result["dof"] >= 100 and 0.1 < result["accept_rate"] < 0.98, result


def test_checkpoint_round_trip_in_peft_layout(target, tmp_path):
    from peft import PeftModel

    from specdec.drafters.medusa_adapted import shallow_copy

    drafter = medusa2(target, adapter_scale=0.5)
    path = drafter.save(tmp_path / "ckpt", target_name=target.name)
    assert not any(t.numel() > 10_000 for t in load_file(path / "model.safetensors").values())
    loaded = drafters.load(path, target)
    ids = torch.randint(0, target.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(ids, None), drafter.module(ids, None))
        # the adapter directory is peft's own: PeftModel loads it onto the base model
        peft_model = PeftModel.from_pretrained(shallow_copy(target.model), path / "adapter")
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, drafter.backbone(input_ids=ids).logits
        )
    assert loaded.steps == 4 and loaded.backbone_weight == drafter.backbone_weight


def test_a_loaded_medusa2_trains_with_the_recipes_loss_weights(target, tmp_path):
    """``drafter.from_pretrained`` naming a Medusa-2 checkpoint: the backbone's weight and the
    heads' decay are the recipe's, not the saved run's (weights [backbone, 1, d, d**2])."""
    path = medusa2(target, backbone_weight=5.0).save(tmp_path / "ckpt", target_name=target.name)
    cfg = MedusaConfig(num_heads=3, lora_rank=4, backbone_weight=2.0, head_weight_decay=0.5,
                       from_pretrained=str(path))  # fmt: skip
    loaded = drafters.for_recipe(cfg, target, None)
    assert loaded.step_weights().tolist() == pytest.approx([2.0, 1.0, 0.5, 0.25])


@pytest.mark.parametrize("fmt", ["medusa", "vllm_medusa"])
def test_export_puts_the_adapted_backbone_beside_the_heads(target, tmp_path, fmt):
    """The export's heads on its own base model's last hidden state give the checkpoint's head
    logits, computed here by Medusa's formula from the exported tensors; the base model is the
    adapted backbone, not the target."""
    from transformers import AutoModelForCausalLM

    from specdec.export import export

    drafter = medusa2(target, adapter_scale=0.5)
    with torch.no_grad():
        for p in drafter.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = drafter.save(tmp_path / "ckpt", target_name=target.name)
    out = export(fmt, path, tmp_path / "export", target)
    config = json.loads((out / "config.json").read_text())
    if fmt == "medusa":
        assert config["base_model_name_or_path"] == str((out / "base_model").resolve())
    base = AutoModelForCausalLM.from_pretrained(out / "base_model").eval()
    ids = torch.randint(0, target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out_base = base(ids, output_hidden_states=True)
        torch.testing.assert_close(out_base.logits, drafter.backbone(input_ids=ids).logits)
        assert (out_base.logits - target.model(ids).logits).abs().max() > 1e-2
        want = drafter.module(ids, None)[1:]  # the heads' steps of the checkpoint
    state = load_file(
        out / ("medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors")
    )
    h = out_base.hidden_states[-1]
    for head in range(3):
        if fmt == "medusa":
            w, b, lm = (state[f"{head}.0.linear.weight"], state[f"{head}.0.linear.bias"],
                        state[f"{head}.1.weight"])  # fmt: skip
        else:
            w, b = state[f"blocks.{head}.layers.0.weight"], state[f"blocks.{head}.layers.0.bias"]
            lm = state["lm_heads.0.weight"]
        x = h + torch.nn.functional.silu(h @ w.T + b)
        torch.testing.assert_close(x @ lm.T, want[head], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vocab", [None, 100])
def test_trains_adapters_and_heads_only_and_scores_against_the_adapted_backbone(
    files, tmp_path, loaded_targets, vocab
):
    from specdec.training.loop import train

    seen = loaded_targets  # the target instance the run trains against
    run_dir = tmp_path / "run"
    args = [
        "train.save_every=100",
        f"drafter.draft_vocab_size={'null' if vocab is None else vocab}",
    ]
    recipe = load_recipe(RECIPE, overrides(files, run_dir, *args))
    assert train(recipe)["steps"] == 4
    before = load_file(files / "target" / "model.safetensors")
    after = seen[0].model.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"target {name} changed"
    ckpt = run_dir / "checkpoints" / "step-000004"
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and t.abs().max() > 0 for k, t in adapter.items())  # trained
    score = json.loads((ckpt / "score.json").read_text())
    assert score["greedy_match_rate"] == 1.0  # to the adapted backbone's plain decoding
    report = score["verifier"]
    assert report["kind"] == "adapted" and report["kl_to_target"] > 0 and report["tokens"] > 0
    assert "not the original target's" in report["note"]
    logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["train/acc@1"] > 0.9  # step 0: the adapted backbone still agrees
    # the saved optimizer: the heads at train.lr's schedule, the adapters at a quarter of it
    saved = torch.load(run_dir / "state" / "optimizer.bin", weights_only=False)
    (heads_group, adapter_group) = saved["param_groups"]
    assert heads_group["initial_lr"] == recipe.train.lr
    assert adapter_group["initial_lr"] == pytest.approx(0.25 * recipe.train.lr)
    assert len(adapter_group["params"]) == len(adapter) > 0  # every lora_A and lora_B
    assert len(heads_group["params"]) > 0
    heads = load_file(ckpt / "model.safetensors")
    if vocab is not None:  # an LM head of their own over the draft vocabulary, trained
        assert heads["lm_head.weight"].shape == (vocab, seen[0].hidden_size)
        rows = before["lm_head.weight"][heads["d2t"] + torch.arange(vocab)]
        assert not torch.equal(heads["lm_head.weight"], rows)
    else:
        assert "lm_head.weight" not in heads and "d2t" not in heads


def test_param_groups_put_the_adapters_at_their_rate(target):
    drafter = medusa2(target)
    drafter.prepare_training(MedusaConfig(lora_rank=4, adapter_lr_scale=0.1), target)
    named = [(n, p) for n, p in drafter.module.named_parameters() if p.requires_grad]
    heads, adapters = drafter.param_groups([p for _, p in named], lr=2e-3)
    assert "lr" not in heads and adapters["lr"] == pytest.approx(2e-4)
    assert {id(p) for p in adapters["params"]} == {id(p) for n, p in named if "lora_" in n}
    assert {id(p) for p in heads["params"]} == {id(p) for n, p in named if n.startswith("heads.")}
    (only,) = drafters.build(target, MedusaConfig(num_heads=2)).param_groups([], lr=1e-3)
    assert only == {"params": []}  # Medusa-1: one group


def test_eval_refuses_a_method_verified_by_its_own_model(capsys, target, tmp_path):
    tiny = tmp_path / "target"
    tiny_models.save_tiny(target.model, target.tokenizer, tiny)
    local = FrozenTarget.load(str(tiny))
    ckpt = medusa2(local).save(tmp_path / "ckpt", target_name=local.name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there."}) + "\n")
    argv = ["eval", "--prompts", str(prompts), "--target", str(tiny), "--method", str(ckpt)]
    err = error_line(capsys, [*argv, "--out", str(tmp_path / "o"), "--num-prompts", "1"])
    assert f"method '{ckpt}': its proposals are verified by a model of its own" in err


def test_no_adapted_projection_and_other_layouts_refused(target, tmp_path):
    from specdec.errors import ConfigError, ModelError
    from specdec.export import export

    with pytest.raises(ConfigError, match=r"lora_target_modules=\[\]: empty: Medusa-2 adapts"):
        load_recipe(RECIPE, ["drafter.lora_target_modules=[]"])
    ckpt = medusa2(target).save(tmp_path / "ckpt", target_name=target.name)
    with pytest.raises(ModelError, match="'medusa' drafter has no 'speculators' layout"):
        export("speculators", ckpt, tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


def test_gradient_checkpointing_recomputes_the_backbone_with_the_same_gradients(target):
    from transformers.modeling_layers import GradientCheckpointingLayer

    def run(checkpointing: bool):
        drafter = medusa2(target, adapter_scale=0.1)
        if checkpointing:
            drafter.prepare_training(MedusaConfig(lora_rank=4, gradient_checkpointing=True), target)
        layers = [
            m
            for m in drafter.backbone.get_base_model().modules()
            if isinstance(m, GradientCheckpointingLayer)
        ]
        calls = []
        for layer in layers:  # a recomputed layer runs its adapted attention again
            layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
        ids = torch.randint(
            0, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3)
        )
        steps = drafter.module(ids, None)
        weights = torch.arange(1.0, 5.0)[:, None, None]
        loss = (weights * torch.log_softmax(steps, -1)[..., :7].sum(-1)).mean()
        forwards = len(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.module.named_parameters() if p.requires_grad}
        return loss.detach(), grads, forwards, len(calls), len(layers)

    loss, grads, forwards, total, n = run(False)
    loss_c, grads_c, forwards_c, total_c, n_c = run(True)
    assert n == n_c == target.num_layers
    assert (forwards, total) == (n, n)  # kept activations: one forward per layer
    assert (forwards_c, total_c) == (n, 2 * n)  # checkpointed: each layer runs again backward
    torch.testing.assert_close(loss_c, loss, atol=0, rtol=0)
    assert grads_c.keys() == grads.keys() and any("lora_A" in k for k in grads)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], atol=1e-6, rtol=1e-5)
    assert all(grads_c[k].abs().sum() > 0 for k in grads if "lora_A" in k)
    # the target itself is neither checkpointed nor in training mode
    assert not any(getattr(m, "gradient_checkpointing", False) for m in target.model.modules())
    assert not any(m.training for m in target.model.modules())


def test_medusa1_heads_from_pretrained_train_on_as_medusa2(target, tmp_path):
    torch.manual_seed(0)
    first = drafters.build(target, MedusaConfig(num_heads=2))
    with torch.no_grad():  # trained heads, no longer the target's read-out
        for name, p in first.model.named_parameters():
            if name.startswith("blocks."):
                p.add_(0.05 * torch.randn_like(p))
    ckpt = first.save(tmp_path / "medusa1", target_name=target.name)
    cfg = MedusaConfig(num_heads=2, from_pretrained=str(ckpt), lora_rank=4, backbone_weight=3.0)
    drafter = drafters.for_recipe(cfg, target, None)
    assert drafter.adapts_target and (drafter.steps, drafter.shift) == (3, 0)
    assert drafter.step_weights().tolist() == pytest.approx([3.0, 1.0, 0.8])
    ids = [3, 14, 15, 9, 2, 6]
    with torch.no_grad():
        steps = drafter.module(torch.tensor([ids]), None)
        heads = first.model(None, None, [last_hidden(target, ids)[None]])
        own = target.model(torch.tensor([ids])).logits
    torch.testing.assert_close(steps[0], own, atol=1e-5, rtol=1e-5)  # B = 0: the target
    torch.testing.assert_close(steps[1:], heads, atol=1e-5, rtol=1e-5)  # the loaded heads
    trainable = {n for n, p in drafter.module.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any(n.startswith("heads.") for n in trainable)


def test_gradient_checkpointing_without_adapters_refused(target, tmp_path):
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"drafter.gradient_checkpointing.*Medusa-2 only"):
        load_recipe(RECIPE, ["drafter.lora_rank=0", "drafter.gradient_checkpointing=true"])
    torch.manual_seed(0)
    heads = drafters.build(target, MedusaConfig(num_heads=2))
    ckpt = heads.save(tmp_path / "medusa1", target_name=target.name)
    cfg = MedusaConfig(num_heads=2, from_pretrained=str(ckpt), gradient_checkpointing=True)
    with pytest.raises(ConfigError, match=re.escape(f"{ckpt} holds Medusa-1 heads and drafter")):
        drafters.for_recipe(cfg, target, None)


#: steps of both runs: one micro-batch of one row at a time, the gradient clipped at every step
ARGS = (
    "train.max_steps=4",
    "train.save_every=2",
    "train.batch_size=1",
    "train.max_grad_norm=0.005",
)


def test_two_ddp_processes_match_one(files, tmp_path):
    """DDP over gloo: the adapters and heads of two processes train as one process's with the
    micro-batches of both."""
    from test_training import finish

    finish(launch(overrides(files, tmp_path / "one", "train.grad_accum=2", *ARGS), recipe=RECIPE))
    two = overrides(files, tmp_path / "two", "train.grad_accum=1", *ARGS)
    finish(launch(two, processes=2, recipe=RECIPE))
    assert_same_training(tmp_path / "one", tmp_path / "two", ["step-000004"])


def test_fsdp_two_processes_match_one_with_accumulation_and_resume_after_sigkill(files, tmp_path):
    """FSDP over gloo: the heads sharded, the adapters (inside the borrowed backbone) kept whole
    on every process with averaged gradients, clipping over both; with two micro-batches a
    process, and a run killed after a save resumes to the same weights."""
    import psutil
    from test_training import finish

    finish(launch(overrides(files, tmp_path / "one", "train.grad_accum=4", *ARGS), recipe=RECIPE))
    run_dir = tmp_path / "fsdp"
    fsdp = overrides(files, run_dir, "train.grad_accum=2", *ARGS)
    proc = launch(fsdp, processes=2, recipe=RECIPE, fsdp=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (run_dir / "checkpoints" / "step-000002").exists():
        time.sleep(0.02)
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.kill()
    out, _ = proc.communicate()
    held = re.findall(r"this process holds (\d+) of its (\d+) parameters \((\d+) replicated\)", out)
    assert len(held) == 2, out[-3000:]  # both processes: half the heads, all the adapters
    (mine0, total, whole), (mine1, _, _) = ((int(x) for x in row) for row in held)
    assert whole > 0 and (mine0 - whole) + (mine1 - whole) == total - whole
    assert min(mine0, mine1) - whole > 0
    out = finish(launch(fsdp, processes=2, recipe=RECIPE, fsdp=True))
    assert "resumed" in out
    assert_same_training(tmp_path / "one", run_dir, ["step-000002", "step-000004"])


def assert_same_training(one: Path, two: Path, steps: list[str]) -> None:
    """Same losses and gradient norms (above the clip bound) at every step, same adapters and
    heads in every named checkpoint."""
    from test_training import losses, metric

    a, b = losses(one), losses(two)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    assert [x for _, x in a] == pytest.approx([x for _, x in b], rel=1e-4, abs=1e-6)
    norms = [metric(run, "train/grad_norm") for run in (one, two)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    assert len(norms[0]) == 4 and min(norms[0]) > 0.005  # the clip bound was in force
    for step in steps:
        for weights in ("adapter/adapter_model.safetensors", "model.safetensors"):
            w1 = load_file(one / "checkpoints" / step / weights)
            w2 = load_file(two / "checkpoints" / step / weights)
            assert set(w1) == set(w2)
            for name in w1:
                torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-4)
