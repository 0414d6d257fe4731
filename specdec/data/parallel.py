"""Regeneration in several processes: each loads the target and writes its share of the shards.

Each worker gets 1/W of the CPU threads and, on a host with several GPUs, its own GPU (worker w
sees only visible GPU w mod count), so each GPU runs its own copy of the target. On a CPU the
workers only help where one ``generate`` leaves cores idle (small batches); batched
``generate`` already keeps them busy (``bench/regenerate_throughput.py --workers``). Every
worker takes every W-th prompt of the length-sorted list (so each gets long and short prompts
alike), numbers its shards ``first + w, first + w + W, ...`` and writes nothing else; the
parent holds the directory's lock, shows progress, writes the manifest and counts the rows on
disk once all are done.

A worker that fails stops the others; rows already written stay and the rerun generates the
rest. A worker whose parent died (SIGKILL) writes what it has and stops after its batch.
Greedy rows equal those of one process (batching does not change them, up to floating-point
ties); sampled rows too, since each prompt draws from its own seeded generator.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable

import torch

from specdec.data.regenerate import Job, generate_batches
from specdec.data.shards import ShardWriter
from specdec.errors import DataError


def generate_in_workers(
    load: Callable[[], tuple], job: Job, workers: int, writer: ShardWriter, report
) -> tuple[int, int, float]:
    """Generates ``job`` in ``workers`` spawned processes; returns new tokens, truncated rows
    and wall-clock seconds (model loading included).

    Args:
        load: picklable; returns ``(model, tokenizer)`` in a worker.
        job: the prompts left and the generation settings.
        workers: processes to start.
        writer: the parent's writer; its next shard number is where the workers start.
        report: ``report(prompts, new_tokens)``, called per finished batch of any worker.

    Raises:
        DataError: a worker failed (its error is named) or died.
    """
    context = mp.get_context("spawn")  # fork would inherit torch's thread pools and locks
    messages = context.Queue()
    threads = max(1, torch.get_num_threads() // workers)
    first, gpus = writer.next_index, visible_gpus()
    args = (load, job, workers, writer.out, first, messages, threads, gpus, os.getpid())
    procs = [context.Process(target=_work, args=(w, *args), daemon=True) for w in range(workers)]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    finished: dict[int, tuple[int, int]] = {}
    try:
        while len(finished) < workers:
            try:
                kind, w, *rest = messages.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs, finished)
                continue
            if kind == "error":
                raise DataError(f"regeneration worker {w} of {workers} failed: {rest[0]}")
            if kind == "done":
                finished[w] = (rest[0], rest[1])
            else:
                report(*rest)
    finally:
        for proc in procs:
            if proc.is_alive() and len(finished) < workers:
                proc.terminate()
            proc.join()
    seconds = time.perf_counter() - start
    return sum(t for t, _ in finished.values()), sum(n for _, n in finished.values()), seconds


def _check_alive(procs, finished: dict) -> None:
    for w, proc in enumerate(procs):
        if w not in finished and proc.exitcode not in (None, 0):
            raise DataError(
                f"regeneration worker {w} of {len(procs)} died (exit code {proc.exitcode}); "
                "rerun to generate the prompts it had left"
            )


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries; none without CUDA."""
    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]


def _work(w, load, job, workers, out, first, messages, threads, gpus, parent) -> None:
    """One worker: load the model, generate prompts ``w::workers``, post progress."""
    if gpus:  # before anything touches CUDA in this fresh process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[w % len(gpus)]
    torch.set_num_threads(threads)
    try:
        model, tokenizer = load()
        name = getattr(model.config, "_name_or_path", "") or ""
        if name != job.model_path:
            raise DataError(
                f"`load` gave model {name!r}, the regeneration is of {job.model_path!r}"
            )
        writer = ShardWriter(out, job.shard_size, None, {}, first_index=first + w, stride=workers)

        def report(prompts: int, tokens: int) -> None:
            messages.put(("progress", w, prompts, tokens))
            if os.getppid() != parent:
                raise SystemExit(f"worker {w}: the parent process is gone")

        batches = job.batches(job.todo[w::workers])
        generator = job.generator(model, tokenizer)
        tokens, truncated, _ = generate_batches(batches, generator, tokenizer, writer, report)
        messages.put(("done", w, tokens, truncated))
    except BaseException as err:  # noqa: BLE001  (reported to the parent, then exit)
        messages.put(("error", w, f"{type(err).__name__}: {err}"))
        raise SystemExit(1) from None
