"""Distillation losses against references written out with plain loops over a tiny vocabulary."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdec import sparse_teacher
from specdec.losses import (
    LOSS_NAMES,
    acceptance_rate,
    distill_loss,
    expected_acceptance,
    masked_mean,
    token_losses,
    top1_agreement,
)
from specdec.sparse_teacher import SparseTeacher

B, T, V = 2, 3, 7


def random_logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=generator) * scale


def probs(row: list[float], temperature: float = 1.0, top_k: int | None = None) -> list[float]:
    """Softmax of one row by hand, optionally keeping only the k largest entries."""
    keep = set(range(len(row)))
    if top_k is not None:
        keep = set(sorted(range(len(row)), key=lambda v: row[v], reverse=True)[:top_k])
    weights = [math.exp(x / temperature) if v in keep else 0.0 for v, x in enumerate(row)]
    total = sum(weights)
    return [w / total for w in weights]


def kl(a: list[float], b: list[float]) -> float:
    return sum(a[v] * math.log(a[v] / b[v]) for v in range(len(a)) if a[v] > 0)


def reference(name, draft, target, *, temperature=1.0, beta=0.5, top_k=None, tokens=None):
    """[B][T] nested list of the loss, one position at a time."""
    out = []
    for b in range(B):
        row = []
        for t in range(T):
            q = probs(draft[b, t].tolist(), temperature)
            p = probs(target[b, t].tolist(), temperature, top_k)
            if name == "forward_kl":
                row.append(kl(p, q))
            elif name == "reverse_kl":
                row.append(kl(q, p))
            elif name == "jsd":
                m = [beta * p[v] + (1 - beta) * q[v] for v in range(V)]
                row.append(beta * kl(p, m) + (1 - beta) * kl(q, m))
            elif name == "tvd":
                row.append(0.5 * sum(abs(p[v] - q[v]) for v in range(V)))
            elif name == "ce":
                y = int(tokens[b, t]) if tokens is not None else max(range(V), key=lambda v: p[v])
                row.append(-math.log(q[y]))
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_each_loss_matches_reference(name):
    draft, target = random_logits(0), random_logits(1)
    got = token_losses(draft, target, name=name)
    assert got.shape == (B, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(name, draft, target), atol=1e-5, rtol=1e-5)


def test_jsd_with_uneven_beta_matches_reference():
    draft, target = random_logits(2), random_logits(3)
    got = token_losses(draft, target, name="jsd", beta=0.2)
    torch.testing.assert_close(got, reference("jsd", draft, target, beta=0.2), atol=1e-6, rtol=1e-5)


def test_identical_distributions_have_zero_divergence():
    logits = random_logits(4)
    for name in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        got = token_losses(logits, logits.clone(), name=name)
        torch.testing.assert_close(got, torch.zeros(B, T), atol=1e-6, rtol=0)


def test_tvd_is_within_unit_interval():
    draft, target = random_logits(5, scale=8.0), random_logits(6, scale=8.0)
    tvd = token_losses(draft, target, name="tvd")
    assert (tvd >= 0).all() and (tvd <= 1).all()
    # Disjoint point masses are at distance 1.
    far = torch.full((1, 1, V), -1e4)
    near = far.clone()
    far[..., 0], near[..., 1] = 1e4, 1e4
    torch.testing.assert_close(token_losses(far, near, name="tvd"), torch.ones(1, 1))


def test_jsd_symmetric_at_half_and_bounded_by_log2():
    draft, target = random_logits(7, scale=6.0), random_logits(8, scale=6.0)
    forward = token_losses(draft, target, name="jsd", beta=0.5)
    swapped = token_losses(target, draft, name="jsd", beta=0.5)
    torch.testing.assert_close(forward, swapped)
    assert (forward >= 0).all() and (forward <= math.log(2) + 1e-6).all()


def test_jsd_limits_approach_the_kls():
    draft, target = random_logits(9, scale=1.0), random_logits(10, scale=1.0)
    small, large = 1e-5, 1 - 1e-5
    near_forward = token_losses(draft, target, name="jsd", beta=small) / small
    near_reverse = token_losses(draft, target, name="jsd", beta=large) / (1 - large)
    torch.testing.assert_close(
        near_forward, reference("forward_kl", draft, target), atol=5e-3, rtol=5e-3
    )
    torch.testing.assert_close(
        near_reverse, reference("reverse_kl", draft, target), atol=5e-3, rtol=5e-3
    )
    for beta in (0.0, 1.0):
        with pytest.raises(ValueError, match="beta"):
            token_losses(draft, target, name="jsd", beta=beta)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_temperature_divides_both_logits(name):
    draft, target = random_logits(11), random_logits(12)
    got = token_losses(draft, target, name=name, temperature=2.5)
    want = reference(name, draft, target, temperature=2.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_losses(draft, target, name=name, temperature=0.0)


@pytest.mark.parametrize("name", ["forward_kl", "jsd", "tvd"])
def test_teacher_top_k_renormalizes_and_stays_finite(name):
    draft, target = random_logits(13), random_logits(14)
    got = token_losses(draft, target, name=name, teacher_top_k=3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(name, draft, target, top_k=3), atol=1e-5, rtol=1e-5)
    # top-k at least V is a no-op
    torch.testing.assert_close(
        token_losses(draft, target, name=name, teacher_top_k=V),
        token_losses(draft, target, name=name),
    )


def test_teacher_top_k_one_is_hard_cross_entropy():
    draft, target = random_logits(15), random_logits(16)
    torch.testing.assert_close(
        token_losses(draft, target, name="forward_kl", teacher_top_k=1),
        token_losses(draft, target, name="ce"),
    )


def test_reverse_kl_with_teacher_top_k_is_refused():
    draft, target = random_logits(17), random_logits(18)
    with pytest.raises(ValueError, match="reverse_kl"):
        token_losses(draft, target, name="reverse_kl", teacher_top_k=3)


def test_ce_matches_torch_cross_entropy():
    draft, target = random_logits(19), random_logits(20)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    got = token_losses(draft, target, name="ce", target_tokens=tokens)
    want = F.cross_entropy(draft.reshape(-1, V), tokens.reshape(-1), reduction="none")
    torch.testing.assert_close(got, want.reshape(B, T))
    # Without tokens the target's argmax is the label; negative ids are ignored.
    argmax = F.cross_entropy(draft.reshape(-1, V), target.argmax(-1).reshape(-1), reduction="none")
    torch.testing.assert_close(token_losses(draft, target, name="ce"), argmax.reshape(B, T))
    tokens[0, 1] = -100
    assert token_losses(draft, target, name="ce", target_tokens=tokens)[0, 1] == 0


def test_masked_mean_partial_and_empty():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    got = masked_mean(values, mask)
    torch.testing.assert_close(got, torch.tensor((1.0 + 3.0 + 5.0) / 3))
    torch.testing.assert_close(masked_mean(values, mask.bool(), num_tokens=6), torch.tensor(1.5))
    torch.testing.assert_close(masked_mean(values, mask, num_tokens=0.5), torch.tensor(18.0))

    empty = masked_mean(values, torch.zeros(B, T, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad
    empty.backward()
    assert torch.equal(values.grad, torch.zeros(B, T))


def test_all_masked_distill_loss_has_zero_finite_gradient():
    draft = random_logits(21).requires_grad_()
    loss, _ = distill_loss(draft, random_logits(22), torch.zeros(B, T), mix={"forward_kl": 1.0})
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(draft.grad, torch.zeros(B, T, V))


def test_num_tokens_splits_into_micro_batches_exactly():
    draft, target = random_logits(23), random_logits(24)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    mix = {"forward_kl": 1.0, "tvd": 0.5}
    full, _ = distill_loss(draft, target, mask, mix=mix)

    def micro_batch(i, num_tokens=None):
        rows = slice(i, i + 1)
        return distill_loss(draft[rows], target[rows], mask[rows], mix=mix, num_tokens=num_tokens)[
            0
        ]

    global_count = mask.sum()
    torch.testing.assert_close(micro_batch(0, global_count) + micro_batch(1, global_count), full)
    # Dividing each micro-batch by its own count would weight the short one too heavily.
    assert not torch.allclose((micro_batch(0) + micro_batch(1)) / 2, full)


def test_mix_weights_sum_the_masked_means():
    draft, target = random_logits(25), random_logits(26)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    loss, parts = distill_loss(draft, target, mask, mix={"reverse_kl": 2.0, "ce": 0.25})
    assert set(parts) == {"reverse_kl", "ce"}
    positions = [(0, 0), (0, 2), (1, 0), (1, 1)]
    rkl = reference("reverse_kl", draft, target)
    ce = reference("ce", draft, target)
    want_rkl = sum(rkl[b, t] for b, t in positions) / len(positions)
    want_ce = sum(ce[b, t] for b, t in positions) / len(positions)
    torch.testing.assert_close(parts["reverse_kl"], want_rkl)
    torch.testing.assert_close(parts["ce"], want_ce)
    torch.testing.assert_close(loss, 2.0 * want_rkl + 0.25 * want_ce)
    assert not parts["ce"].requires_grad


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradients_reach_draft_only(name):
    draft = random_logits(27).requires_grad_()
    target = random_logits(28)
    loss, _ = distill_loss(draft, target, torch.ones(B, T), mix={name: 1.0})
    loss.backward()
    assert torch.isfinite(draft.grad).all() and draft.grad.abs().sum() > 0
    assert target.grad is None
    # Even a target that asks for gradients is treated as frozen.
    assert not token_losses(draft.detach(), target.requires_grad_(), name=name).requires_grad


def test_negative_infinite_logits_give_finite_gradients():
    draft = random_logits(29)
    target = random_logits(30)
    draft[..., 0] = -math.inf
    target[..., 0] = -math.inf
    draft.requires_grad_()
    mix = {"forward_kl": 1.0, "reverse_kl": 1.0, "jsd": 1.0, "tvd": 1.0}
    loss, _ = distill_loss(draft, target, torch.ones(B, T), mix=mix)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.grad).all()


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_bf16_inputs_are_computed_in_float32(name):
    draft, target = random_logits(31).bfloat16(), random_logits(32).bfloat16()
    got = token_losses(draft, target, name=name)
    assert got.dtype == torch.float32
    want = reference(name, draft.float(), target.float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_name_is_refused_by_name():
    draft, target = random_logits(33), random_logits(34)
    with pytest.raises(ValueError, match="'kl_forward'"):
        token_losses(draft, target, name="kl_forward")
    with pytest.raises(ValueError, match="'kl_forward'"):
        distill_loss(draft, target, torch.ones(B, T), mix={"tvd": 1.0, "kl_forward": 1.0})


def test_mismatched_vocabularies_are_refused():
    with pytest.raises(ValueError, match="same V"):
        token_losses(torch.zeros(B, T, V), torch.zeros(B, T, V + 1), name="tvd")


def test_top1_agreement_counts_unmasked_matches():
    draft, target = random_logits(35), random_logits(36)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    matches = [
        float(int(draft[b, t].argmax()) == int(target[b, t].argmax()))
        for b in range(B)
        for t in range(T)
        if mask[b, t]
    ]
    want = torch.tensor(sum(matches) / len(matches))
    torch.testing.assert_close(top1_agreement(draft, target, mask), want)
    torch.testing.assert_close(top1_agreement(target, target, mask), torch.tensor(1.0))
    assert top1_agreement(draft, target, torch.zeros(B, T)).item() == 0.0


def test_expected_acceptance_is_one_minus_tvd():
    draft, target = random_logits(37), random_logits(38)
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    tvd = reference("tvd", draft, target, temperature=0.7)
    kept = [1.0 - tvd[b, t] for b in range(B) for t in range(T) if mask[b, t]]
    want = (sum(kept) / len(kept)).clone()
    torch.testing.assert_close(expected_acceptance(draft, target, mask, temperature=0.7), want)
    torch.testing.assert_close(
        expected_acceptance(target, target, mask), torch.tensor(1.0), atol=1e-6, rtol=0
    )


def sparse_case(seed: int, keep: int, width: int = 12, vocab: int = 30):
    """A target distribution over ``vocab`` tokens stored as a top-``keep`` cache does, over a
    draft vocabulary of ``width`` of them (some top tokens fall outside it), and the same
    teacher written out in full by hand: ``(SparseTeacher, [B, T, width] log-probabilities)``."""
    g = torch.Generator().manual_seed(seed)
    full = torch.log_softmax(torch.randn(B, T, vocab, generator=g) * 3, dim=-1)
    draft_ids = torch.randperm(vocab, generator=g)[:width].tolist()
    values, cols, fill = [], [], []
    dense = torch.empty(B, T, width)
    for b in range(B):
        for t in range(T):
            row = full[b, t].tolist()
            top = sorted(range(vocab), key=lambda v: row[v], reverse=True)[:keep]
            rest = math.log(1 - sum(math.exp(row[v]) for v in top)) - math.log(vocab - keep)
            inside = [v for v in top if v in draft_ids]
            values.append([row[v] for v in inside] + [-math.inf] * (keep - len(inside)))
            cols.append([draft_ids.index(v) for v in inside] + [0] * (keep - len(inside)))
            fill.append(rest)
            for c, v in enumerate(draft_ids):
                dense[b, t, c] = row[v] if v in top else rest
    sparse = SparseTeacher(
        torch.tensor(values).view(B, T, keep),
        torch.tensor(cols).view(B, T, keep),
        torch.tensor(fill).view(B, T),
        width,
    )
    return sparse, dense


@pytest.mark.parametrize(("keep", "temperature"), [(5, 1.0), (5, 0.7), (1, 1.0), (12, 2.0)])
def test_sparse_teacher_gives_the_dense_forward_kl_acceptance_and_gradient(keep, temperature):
    """Forward KL, its gradient and the acceptance overlap from the top-k form equal the same
    quantities on the teacher written out in full (renormalised over the draft vocabulary for
    the loss, not for the overlap)."""
    sparse, dense = sparse_case(seed=keep, keep=keep)
    assert (sparse.values == -math.inf).any()  # some top tokens lie outside the draft's
    draft = (torch.randn(B, T, 12, generator=torch.Generator().manual_seed(9)) * 2).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    p = torch.softmax(dense / temperature, dim=-1)
    log_q = torch.log_softmax(draft / temperature, dim=-1)
    expected = (p * (p.log() - log_q)).sum(-1)[mask.bool()].mean()
    (want,) = torch.autograd.grad(expected, draft)
    loss, parts = distill_loss(
        draft, sparse, mask, mix={"forward_kl": 1.0}, temperature=temperature
    )
    (got,) = torch.autograd.grad(loss, draft)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    assert parts["forward_kl"] == pytest.approx(float(expected.detach()), abs=1e-5)
    overlap = torch.minimum(dense.exp(), torch.softmax(draft.detach(), -1)).sum(-1)
    accept = acceptance_rate(draft.detach(), sparse, mask)
    assert float(accept) == pytest.approx(float(overlap[mask.bool()].mean()), abs=1e-6)
    assert torch.equal(sparse.dense(), dense)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sparse_forward_kl_in_chunks_and_from_bfloat16_logits(temperature, monkeypatch):
    """The fused forward KL works a few rows at a time: with chunks of 4 of the 6 positions
    (one chunk partial) its loss and gradient are the dense reference's, the float32 logits it
    read are left as they were after the backward (it works on copies of them), and bfloat16
    logits get a bfloat16 gradient equal to the reference on the same values in float32."""
    monkeypatch.setattr(sparse_teacher, "CHUNK_ROWS", 4)
    sparse, dense = sparse_case(seed=3, keep=5)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    p = torch.softmax(dense / temperature, dim=-1)
    start = torch.randn(B, T, 12, generator=torch.Generator().manual_seed(4)) * 2
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        draft = start.to(dtype, copy=True).requires_grad_()
        before = draft.detach().clone()
        reference = draft.detach().float().requires_grad_()
        log_q = torch.log_softmax(reference / temperature, dim=-1)
        expected = (p * (p.log() - log_q)).sum(-1)[mask.bool()].mean()
        (want,) = torch.autograd.grad(expected, reference)
        loss, _ = distill_loss(
            draft, sparse, mask, mix={"forward_kl": 1.0}, temperature=temperature
        )
        loss.backward()
        assert draft.grad.dtype == dtype
        assert torch.equal(draft.detach(), before)
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.grad.float(), want, atol=tol * 1e-1, rtol=tol)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sparse_teacher_gives_the_dense_mix_of_forward_kl_and_hard_ce(temperature, monkeypatch):
    """Forward KL plus hard CE on the target's tokens from the top-k form, the teacher never
    written out: the loss, each part and the gradient equal those computed by hand on the
    teacher in full; a token outside the draft vocabulary (-1) costs nothing."""
    sparse, dense = sparse_case(seed=5, keep=4)
    draft = (torch.randn(B, T, 12, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tokens = torch.tensor([[3, -1, 7], [0, 11, -1]])
    p = torch.softmax(dense / temperature, dim=-1)
    log_q = torch.log_softmax(draft / temperature, dim=-1)
    kl = (p * (p.log() - log_q)).sum(-1)
    ce = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            if tokens[b, t] >= 0:
                ce[b, t] = -log_q[b, t, tokens[b, t]]
    kept = mask.bool()
    want_kl, want_ce = kl[kept].sum() / 5, ce[kept].sum() / 5
    expected = 0.25 * want_kl + 0.75 * want_ce
    (want,) = torch.autograd.grad(expected, draft)

    def written_out(self):
        raise AssertionError("the teacher was written out in full")

    monkeypatch.setattr(SparseTeacher, "dense", written_out)
    mix = {"forward_kl": 0.25, "ce": 0.75}
    loss, parts = distill_loss(
        draft, sparse, mask, mix=mix, temperature=temperature, target_tokens=tokens
    )
    (got,) = torch.autograd.grad(loss, draft)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    assert float(parts["forward_kl"]) == pytest.approx(float(want_kl), abs=1e-5)
    assert float(parts["ce"]) == pytest.approx(float(want_ce), abs=1e-5)


def test_sparse_teacher_is_written_out_for_any_other_loss():
    """A mix beyond the forward KL reads the teacher in full: the same loss as from the dense
    tensor."""
    sparse, dense = sparse_case(seed=3, keep=4)
    draft, mask = torch.randn(B, T, 12), torch.ones(B, T)
    mix = {"forward_kl": 1.0, "tvd": 0.5}
    from_sparse, _ = distill_loss(draft, sparse, mask, mix=mix)
    from_dense, _ = distill_loss(draft, dense, mask, mix=mix)
    torch.testing.assert_close(from_sparse, from_dense)
