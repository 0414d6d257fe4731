"""The decoding forward's matrix products: every kernel is the product, the measured choice is
the fastest at each row count, and a session uses it at that row count."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decoding import compact, kernels
from specdec.drafters.base import decoding_dtype

CPU_KERNELS = [
    (name, dtype)
    for dtype in (torch.float32, torch.float16)
    for name in kernels.kernels_for(torch.device("cpu"), dtype)
]


@pytest.mark.parametrize(("name", "dtype"), CPU_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 40])
def test_every_kernel_is_the_product(name, dtype, rows):
    """Checked in float64, with and without a bias, flat and batched inputs."""
    torch.manual_seed(0)
    x, weight, bias = (
        t.to(dtype) for t in (torch.randn(rows, 24), torch.randn(40, 24), torch.randn(40))
    )
    packed = kernels.reorder(weight) if name == "reordered" else None
    expected = x.double() @ weight.double().t()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for b in (bias, None):
        want = (expected + b.double() if b is not None else expected).to(dtype)
        for shape in ((rows, 24), (1, rows, 24)):
            out = kernels.KERNELS[name](x.view(shape), weight, b, packed)
            assert out.shape == (*shape[:-1], 40) and out.is_contiguous() and out.dtype == dtype
            torch.testing.assert_close(out.view(rows, 40), want, atol=tolerance, rtol=tolerance)


def _slow_unless(fast_rows):
    """``F.linear`` that sleeps 3 ms a call at row counts outside ``fast_rows``."""

    def kernel(x, weight, bias=None, packed=None):
        if x.numel() // x.shape[-1] not in fast_rows:
            time.sleep(0.003)
        return F.linear(x, weight, bias)

    return kernel


def test_measure_picks_the_fastest_kernel_at_each_row_count():
    """Two kernels, each slow where the other is fast: the choice follows the planted speeds
    (and, measured with planted kernels, is not remembered for the real ones)."""
    table = {"small": _slow_unless({1, 2}), "large": _slow_unless({4, 8, 16})}
    torch.manual_seed(0)
    weights = [(torch.randn(16, 8), None), (torch.randn(8, 16), torch.randn(8))]
    rows = (1, 2, 4, 8)
    choice = kernels.measure(weights, ("small", "large"), rows=rows, table=table)
    assert choice == {1: "small", 2: "small", 4: "large", 8: "large"}
    assert kernels.measured(weights, ("small", "large"), rows) is None


def test_tuned_linear_takes_the_kernel_of_the_nearest_measured_row_count_below():
    called = []

    def recording(name):
        def kernel(x, weight, bias=None, packed=None):
            called.append(name)
            return F.linear(x, weight, bias)

        return kernel

    table = {n: recording(n) for n in "abc"}
    tuned = kernels.TunedLinear({3: "b", 1: "a", 8: "c"}, table=table)
    torch.manual_seed(0)
    weight = torch.randn(5, 4)
    for rows in (1, 2, 3, 7, 8, 50):
        x = torch.randn(1, rows, 4)
        torch.testing.assert_close(tuned(x, weight), x @ weight.t())
    assert called == ["a", "a", "b", "b", "c", "c"]
    assert tuned.uses == {"a", "b", "c"}


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_tuned_session_measures_once_per_process_and_keeps_reordered_weights_only_if_used(
    monkeypatch,
):
    model = _llama()
    first = compact.CompactSession(model, torch.float32, layout="tuned")
    measured = first.linear.choice
    assert set(measured) == set(kernels.TUNED_ROWS)
    assert first.linear.uses <= set(kernels.kernels_for(torch.device("cpu"), torch.float32))

    def no_second_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "measure", no_second_measure)
    second = compact.CompactSession(_llama(), torch.float32, layout="tuned")
    assert second.linear.choice == measured
    tuples = [second.head, *(t for layer in second.layers for t in (layer.q, layer.down))]
    assert {len(t) for t in tuples} == ({3} if "reordered" in measured.values() else {2})


def test_fixed_layouts_keep_reordered_weights_only_where_they_use_them():
    model = _llama()
    assert len(compact.CompactSession(model, torch.float32, layout="transposed").head) == 2
    if kernels.packing_available():
        assert len(compact.CompactSession(model, torch.float32, layout="packed").head) == 3


def test_a_small_head_gets_a_tuned_linear_without_reordered_weights():
    head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
    tuned = kernels.tuned_linear(head)
    assert set(tuned.choice) == set(kernels.TUNED_ROWS)
    assert tuned.uses <= {"linear", "transposed"}
    x = torch.randn(3, 8)
    torch.testing.assert_close(tuned(x, head[0].weight, head[0].bias), head[0](x))


def _slow_in(dtype):
    """``F.linear`` that sleeps 3 ms a call in ``dtype``."""

    def kernel(x, weight, bias=None, packed=None):
        if x.dtype == dtype:
            time.sleep(0.003)
        return F.linear(x, weight, bias)

    return kernel


@pytest.mark.parametrize("slow", [torch.float16, torch.float32])
def test_the_decoding_dtype_is_the_one_measured_faster(slow):
    """The kernels planted slow in one dtype: the other is chosen."""
    table = dict.fromkeys(["linear", "transposed", "reordered"], _slow_in(slow))
    head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    expected = torch.float32 if slow == torch.float16 else torch.float16
    assert kernels.fastest_dtype(head, (torch.float16, torch.float32), table=table) == expected


def test_the_decoding_dtype_is_measured_through_the_kernels_the_drafter_runs():
    """F.linear planted slow in float32, W @ x.T in float16: a drafter that runs F.linear
    alone decodes in float16, one that runs W @ x.T alone in float32."""
    table = {"linear": _slow_in(torch.float32), "transposed": _slow_in(torch.float16)}
    head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    both = (torch.float16, torch.float32)
    assert kernels.fastest_dtype(head, both, ("linear",), table=table) == torch.float16
    assert kernels.fastest_dtype(head, both, ("transposed",), table=table) == torch.float32


class _Heads(torch.nn.Module):
    def __init__(self, own_head: bool):
        super().__init__()
        self.block = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 5, bias=False) if own_head else None
        self._target_head = (torch.nn.Linear(8, 30, bias=False),)  # not a submodule

    @property
    def borrowed_head(self):
        return self._target_head[0] if self.lm_head is None else None


def test_the_products_of_a_step_include_a_borrowed_head():
    shapes = [tuple(w.shape) for w, _ in kernels.products(_Heads(own_head=False))]
    assert shapes == [(8, 8), (30, 8)]
    shapes = [tuple(w.shape) for w, _ in kernels.products(_Heads(own_head=True))]
    assert shapes == [(8, 8), (5, 8)]


def test_auto_decodes_in_the_measured_dtype_and_a_named_dtype_is_kept(monkeypatch):
    asked = []

    def stub(module, dtypes, kernels_used=None):
        asked.append((dtypes, kernels_used))
        return chosen

    monkeypatch.setattr(kernels, "fastest_dtype", stub)
    head = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(24, 4))
    for chosen in (torch.float16, torch.float32):
        assert decoding_dtype("auto", head) == chosen
    assert decoding_dtype("auto", head, ("linear",)) == chosen
    assert asked == [((torch.float16, torch.float32), None)] * 2 + [
        ((torch.float16, torch.float32), ("linear",))
    ]
    assert decoding_dtype("float16", head) == torch.float16
    assert decoding_dtype("transformers", head) == torch.float32
    assert decoding_dtype("auto", head.to(torch.float16)) == torch.float16  # nothing to halve
    assert len(asked) == 3


def test_a_choice_is_described_by_row_count_ranges():
    tuned = kernels.TunedLinear(
        {1: "linear", 2: "linear", 4: "reordered", 8: "reordered", 32: "linear"}
    )
    assert tuned.describe() == "1-3 rows linear, 4-31 rows reordered, 32+ rows linear"
    assert kernels.TunedLinear({1: "transposed"}).describe() == "1+ rows transposed"
