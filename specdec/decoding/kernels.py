"""The matrix products of a decoding forward, and the choice among them measured on this host.

Decoding one token of a small model on a CPU is bound by how fast the linear layers' weights are
read, and which kernel reads them fastest depends on the CPU and on the number of rows, in ways
no rule of thumb predicts. Two cores of two x86-64 hosts with AVX-512, float32, SmolLM2-135M's
linear layers and head (``bench/compact_forward.py``):

==========================  =========================  =========================
one row (three rows)        AMD EPYC                   Intel Xeon with AMX
==========================  =========================  =========================
``F.linear``                53 ms (104 ms)             30 ms (34 ms)
``W @ x.T``                 29 ms (40 ms)              63 ms (64 ms)
oneDNN, reordered weights   about 36 ms from 3 rows    44 ms from 3 rows
==========================  =========================  =========================

A layout fixed from one host's numbers costs the other up to 2x on every decoding step. So the
``tuned`` layout times each kernel on the model's own weight shapes at the row counts decoding
uses (one token; a verify of k + 1; a tree; a batch of sequences), once per process, and
computes each product through the fastest at its row count. All kernels compute the same
``x @ W.T + b``; they differ in float rounding only, as any two BLAS calls may.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: the batch size oneDNN reorders the weights for
PACKED_FOR_ROWS = 4
#: the row counts the ``tuned`` layout times; a count between two takes the lower one's kernel,
#: a larger one the last one's
TUNED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, packed=None) -> torch.Tensor:
    """``F.linear`` (``packed`` is ignored)."""
    return F.linear(x, weight, bias)


def transposed(x: torch.Tensor, weight: torch.Tensor, bias=None, packed=None) -> torch.Tensor:
    """``F.linear`` as ``weight @ x.T`` (a single row is doubled to stay off the matrix-vector
    kernel); the result is made contiguous so the next product sees the same layout."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = rows.expand(2, -1).contiguous()
    y = weight @ rows.t()
    y = (y[:, :1] if single else y).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def packing_available() -> bool:
    """Whether this torch has oneDNN's reordered-weight linear (CPU builds with MKL-DNN)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as oneDNN reorders it for :func:`reordered` (float32, CPU)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)


def reordered(x: torch.Tensor, weight: torch.Tensor, bias=None, packed=None) -> torch.Tensor:
    """``F.linear`` through ``packed``, ``weight`` reordered by :func:`reorder`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


#: every kernel by name; each takes ``(x, weight, bias=None, packed=None)``
KERNELS: dict[str, Callable] = {
    "linear": linear,
    "transposed": transposed,
    "reordered": reordered,
}


def kernels_for(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels worth timing for weights on ``device`` in ``dtype``: on a CPU ``F.linear``
    and ``W @ x.T``, in float32 also oneDNN's reordered weights where it is there; elsewhere
    ``F.linear`` alone."""
    if device.type != "cpu":
        return ("linear",)
    packs = dtype == torch.float32 and packing_available()
    return ("linear", "transposed") + (("reordered",) if packs else ())


# measured choices, one per host process: (device, dtype, threads, kernels, rows, weight
# shapes) -> {rows: kernel}; timing depends on nothing else, and retiming costs seconds
_MEASURED: dict[tuple, dict[int, str]] = {}
# the same for the decoding dtype: (device, threads, dtypes, kernels, weight shapes) -> dtype
_DTYPES: dict[tuple, torch.dtype] = {}


def _shapes(weights: Sequence[tuple]) -> frozenset:
    return frozenset(Counter((tuple(t[0].shape), t[1] is not None) for t in weights).items())


def _key(weights: Sequence[tuple], kernels: Sequence[str], rows: Sequence[int]) -> tuple:
    w = weights[0][0]
    threads = torch.get_num_threads()
    return (str(w.device), w.dtype, threads, tuple(kernels), tuple(rows), _shapes(weights))


def measured(
    weights: Sequence[tuple], kernels: Sequence[str], rows: Sequence[int] = TUNED_ROWS
) -> dict[int, str] | None:
    """The choice already measured in this process for these weights' shapes, if any."""
    return _MEASURED.get(_key(weights, kernels, rows))


def _timings(weights, kernels, rows, repeats, table) -> dict[tuple[int, str], float]:
    """``{(rows, kernel): seconds}``: the fastest of ``repeats`` runs of every product of
    ``weights`` through the kernel, the kernels taking turns on the same random inputs."""
    w = weights[0][0]
    gen = torch.Generator(device=w.device).manual_seed(0)
    best = {(m, k): float("inf") for m in rows for k in kernels}
    with torch.inference_mode():
        inputs = {
            m: {
                n: torch.randn(m, n, generator=gen, device=w.device).to(w.dtype)
                for n in {t[0].shape[1] for t in weights}
            }
            for m in rows
        }
        for _ in range(repeats):
            for m in rows:
                for k in kernels:
                    kernel, x = table[k], inputs[m]
                    start = time.perf_counter()
                    for weight, bias, *packed in weights:
                        kernel(x[weight.shape[1]], weight, bias, *packed)
                    best[m, k] = min(best[m, k], time.perf_counter() - start)
    return best


def measure(
    weights: Sequence[tuple],
    kernels: Sequence[str],
    rows: Sequence[int] = TUNED_ROWS,
    repeats: int = 2,
    table: dict[str, Callable] = KERNELS,
) -> dict[int, str]:
    """For each row count, the kernel of ``kernels`` that computes every product of
    ``weights`` (tuples ``(weight, bias[, reordered weight])``) in the least time, each kernel
    timed ``repeats`` times (the fastest run counts, so a first call's setup does not; CPU
    kernels only: the clock is not synchronised with a device). Remembered for the process
    (:func:`measured`) unless ``table`` is not :data:`KERNELS`."""
    key = _key(weights, kernels, rows)
    if len(kernels) == 1:
        return _MEASURED.setdefault(key, dict.fromkeys(rows, kernels[0]))
    if weights[0][0].device.type != "cpu":
        raise ValueError("kernels are timed on a CPU only (the clock does not wait for a device)")
    best = _timings(weights, kernels, rows, repeats, table)
    choice = {m: min(kernels, key=lambda k, m=m: best[m, k]) for m in rows}
    logger.info(
        "matrix products of %d weights: %s (measured on this host)",
        len(weights),
        ", ".join(f"{m} rows {k} {1000 * best[m, k]:.1f} ms" for m, k in choice.items()),
    )
    if table is KERNELS:  # (planted kernels, in tests, are not remembered)
        _MEASURED[key] = choice
    return choice


def products(module: torch.nn.Module) -> list[tuple]:
    """``(weight, bias)`` of every matrix product of ``module``'s decoding step: its
    ``nn.Linear`` layers, and the LM head it reads out through when that is borrowed from the
    target (``module.borrowed_head``: not a submodule, yet the largest product)."""
    layers = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    head = getattr(module, "borrowed_head", None)
    if head is not None:
        layers.append(head)
    pairs = [(m.weight, getattr(m, "bias", None)) for m in layers]
    return [(w.detach(), b if b is None else b.detach()) for w, b in pairs]


def fastest_dtype(
    module: torch.nn.Module,
    dtypes: Sequence[torch.dtype],
    kernels: Sequence[str] | None = None,
    repeats: int = 3,
    table: dict[str, Callable] = KERNELS,
) -> torch.dtype:
    """Of ``dtypes``, the one in which the products of ``module``'s decoding step
    (:func:`products`) of one row take the least time on this CPU, each dtype through its
    fastest of ``kernels`` (default: every one it has but the reordered weights). Measured once
    per process for these weight shapes; off a CPU, the module's own dtype.

    A draft step on a CPU is bound by reading its weights, so float16 halves it where the CPU
    multiplies float16 as fast as float32 (an AMD EPYC: c 0.157 -> 0.059 for the reference
    draft model), and loses where its float32 kernels are the faster (an Intel Xeon with AMX)."""
    pairs = products(module)
    device = pairs[0][0].device
    if device.type != "cpu":
        return pairs[0][0].dtype
    names = tuple(kernels or ())
    key = (str(device), torch.get_num_threads(), tuple(dtypes), names, _shapes(pairs))
    if key in _DTYPES:
        return _DTYPES[key]
    seconds = {}
    for dt in dtypes:
        weights = [(w.to(dt), None if b is None else b.to(dt)) for w, b in pairs]
        usable = [k for k in kernels_for(device, dt) if k != "reordered"]
        usable = [k for k in usable if k in names] if names else usable
        seconds[dt] = min(_timings(weights, usable, (1,), repeats, table).values())
    fastest = min(dtypes, key=seconds.get)
    logger.info(
        "decoding dtype of %d weights: %s (one row: %s; measured on this host)",
        len(pairs),
        fastest,
        ", ".join(f"{dt} {1000 * t:.2f} ms" for dt, t in seconds.items()),
    )
    if table is KERNELS:
        _DTYPES[key] = fastest
    return fastest


class TunedLinear:
    """``F.linear`` through the kernel ``choice`` names for the row count of ``x``.

    Args:
        choice: ``{rows: kernel name}`` (:func:`measure`); a row count between two takes the
            lower one's kernel, one past the last the last one's.
        table: the kernels by name.
    """

    def __init__(self, choice: dict[int, str], table: dict[str, Callable] = KERNELS):
        self.choice = dict(sorted(choice.items()))
        top, current = max(self.choice), None
        self._by_rows = []
        for m in range(top + 1):
            current = self.choice.get(m, current) or self.choice[min(self.choice)]
            self._by_rows.append(table[current])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None, packed=None):
        rows = x.numel() // x.shape[-1]
        kernel = self._by_rows[min(rows, len(self._by_rows) - 1)]
        return kernel(x, weight, bias, packed)

    @property
    def uses(self) -> set[str]:
        """The kernels it calls."""
        return set(self.choice.values())

    def describe(self) -> str:
        """The choice in words, by row-count ranges: ``1-3 rows linear, 4+ rows reordered``."""
        items = list(self.choice.items())
        runs = [(m, k) for i, (m, k) in enumerate(items) if i == 0 or items[i - 1][1] != k]
        words = []
        for (m, kernel), after in zip(runs, [*runs[1:], None], strict=True):
            end = None if after is None else after[0] - 1
            span = f"{m}+" if end is None else (f"{m}" if end == m else f"{m}-{end}")
            words.append(f"{span} rows {kernel}")
        return ", ".join(words)


def tuned_linear(module: torch.nn.Module) -> TunedLinear:
    """The fastest ``F.linear`` (without reordered weights) for the products of ``module``'s
    decoding step (:func:`products`) on this host: for a small head that decodes on weights
    still being trained, where reordered copies would go stale."""
    weights = products(module)
    weight = weights[0][0]
    kernels = tuple(k for k in kernels_for(weight.device, weight.dtype) if k != "reordered")
    return TunedLinear(measured(weights, kernels) or measure(weights, kernels))
