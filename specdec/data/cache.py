"""The target's teacher, cached: one pass of the frozen target over the training data, read back
by training instead of running the target on every batch (``data.teacher: cache``).

What a row stores:
- the hidden states of the layers the drafter reads, at every position;
- the target's next-token log-probabilities where a loss needs them: at position t when token
  t + 1 is an assistant token (every drafter step's teacher row is such a position, see
  ``Drafter.teacher``); over the full vocabulary (``top_k: 0``) or as the top k with their
  ids and the log of the remaining mass.

Read back (:mod:`specdec.data.cache_read`), a full row is the stored distribution; a top-k row
is the target's distribution on its k most likely tokens with the remaining mass spread evenly
over the other V - k. Its top token is the target's (no tail token can exceed the k-th), and
it stays a distribution, so every loss and acceptance measure is computable; what it loses is
the shape of the tail (measured: ``tests/test_cache.py``, README). Positions without a stored
teacher read back as uniform; no loss reads them.

Storage dtypes: float32 (exact), float16, bfloat16, fp8 (e4m3; each token's values, per
layer, divided by their absolute maximum / 448 before the cast, the scale kept in float32).

Layout of a cache directory::

    manifest.json             format, the fingerprint it was made for, who made it (the
                              recipe's and the tokenizer's hashes), counts (atomic writes)
    recipe.yaml               the resolved recipe that started it
    shard-00000.safetensors   rows [0, shard_rows), then the next rows, ...; each shard is
                              written to a temporary name, fsynced and renamed, so a killed
                              run leaves whole shards only and resumes with the shards that
                              are missing or hold other rows than theirs (a grown cache)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specdec.data.shards import MANIFEST, locked, read_manifest, write_atomic
from specdec.errors import DataError

logger = logging.getLogger(__name__)

FORMAT = "specdec-teacher-cache/1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
RECIPE = "recipe.yaml"  # the resolved recipe that started the cache, for people
MIN_LOG_REST = -60.0  # the remaining mass is kept at least e^-60, so no log-probability is -inf


def fingerprint(target, target_cfg, dataset, layers, cfg) -> dict:
    """What a cache is valid for: the target (its dtype, configuration and a weight checksum,
    not where it was loaded from), the tokenized training rows, the layers, the teacher's top-k
    and the storage dtype."""
    config = {k: v for k, v in target.model.config.to_dict().items() if not k.startswith("_")}
    config.pop("transformers_version", None)
    with torch.no_grad():
        checksum = sum(float(p.sum(dtype=torch.float64)) for p in target.model.parameters())
    return {
        "target": {
            "dtype": target_cfg.dtype,
            "config_sha256": hashlib.sha256(
                json.dumps(config, sort_keys=True).encode()
            ).hexdigest(),
            "weight_sum": f"{checksum:.8g}",
        },
        "data_sha256": data_sha256(dataset),
        "rows": len(dataset),
        "layers": [int(i) for i in layers],
        "top_k": int(cfg.top_k),
        "dtype": cfg.dtype,
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.model.config.hidden_size),
        "shard_rows": int(cfg.shard_rows),
    }


def data_sha256(dataset, rows: int | None = None) -> str:
    """sha256 of the first ``rows`` (None: all) tokenized rows of ``dataset``, in order: a
    cache's ``data_sha256`` also names the first rows of any dataset grown from its own."""
    data = hashlib.sha256()
    pairs = zip(dataset["input_ids"], dataset["loss_mask"], strict=True)
    for ids, mask in itertools.islice(pairs, rows):
        data.update(json.dumps([ids, mask]).encode())
    return data.hexdigest()


def grown(manifest: dict, fp: dict, dataset) -> dict | None:
    """The fingerprint of the cache ``manifest`` grown to ``dataset`` (``fp``), when
    ``dataset`` is the cached rows with more after them (prompt sources added to a
    regeneration append their rows); None otherwise. The rest of the fingerprint is the
    caller's to check (:func:`check_fingerprint`)."""
    old = manifest.get("fingerprint", {})
    n = old.get("rows")
    if not isinstance(n, int) or not 0 < n < fp["rows"]:
        return None
    if data_sha256(dataset, n) != old.get("data_sha256"):
        return None
    return old | {"data_sha256": fp["data_sha256"], "rows": fp["rows"]}


def shards_to_do(out: Path, rows: int, size: int) -> list[int]:
    """The shards of a cache of ``rows`` rows not in ``out`` whole: missing, unreadable, or
    holding other than their rows (the last shard of a cache since grown)."""
    todo = []
    for j in range(math.ceil(rows / size)):
        want = len(shard_range(j, rows, size))
        try:
            with safe_open(str(out / shard_name(j)), framework="pt") as shard:
                held = shard.get_slice("row_offsets").get_shape()[0] - 1
        except Exception:  # missing, or a foreign or truncated file: written again
            held = None
        if held != want:
            todo.append(j)
    return todo


def teacher_positions(loss_mask: list[int]) -> list[int]:
    """Positions whose next token is an assistant token: where the teacher is stored."""
    return [t for t in range(len(loss_mask) - 1) if loss_mask[t + 1]]


def estimate_bytes(dataset, fp: dict) -> int:
    """Disk a cache of ``dataset`` will take, from its token and teacher-position counts."""
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    taught = sum(len(teacher_positions(m)) for m in dataset["loss_mask"])
    width = 1 if fp["dtype"] == "fp8" else DTYPES[fp["dtype"]].itemsize
    scale = 4 if fp["dtype"] == "fp8" else 0
    per_token = 4 + len(fp["layers"]) * (fp["hidden_size"] * width + scale)
    k = fp["top_k"]
    per_teacher = 8 + scale + (fp["vocab_size"] * width if k == 0 else k * (width + 4) + 4)
    return tokens * per_token + taught * per_teacher


def pack(x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """``x`` [..., D] float32 in the storage dtype (fp8: with a scale per leading index)."""
    if dtype != "fp8":
        return {"": x.to(DTYPES[dtype]).contiguous()}
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return {
        "": (x / scale).to(torch.float8_e4m3fn).contiguous(),
        "_scale": scale.squeeze(-1).float().contiguous(),
    }


def unpack(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = stored.float()
    return x if scale is None else x * scale.unsqueeze(-1)


def shard_name(j: int) -> str:
    return f"shard-{j:05d}.safetensors"


def check_fingerprint(
    out: Path, manifest: dict, fp: dict, where: str = "data.cache.dir", hint: str = ""
) -> None:
    """Raise DataError naming the first thing ``out`` was cached for that differs from now
    (:func:`differs`). ``where`` names the setting that pointed at ``out``; ``hint``, what to
    do instead."""
    old = manifest.get("fingerprint", {})
    key = differs(old, fp)
    if key is not None:
        raise DataError(
            f"{where}: {out} holds a teacher cache of another {key} "
            f"({old.get(key)!r} there, {fp[key]!r} now); "
            + (hint or "use another data.cache.dir or delete that one")
        )


def differs(old: dict, fp: dict) -> str | None:
    """The first key of ``fp`` the cached fingerprint ``old`` differs in, the data last (grown
    data may differ in something else too); None when it serves ``fp`` (a cache of more
    layers than asked for serves: one cache for drafters that read fewer)."""
    data = ("data_sha256", "rows")
    for key, value in sorted(fp.items(), key=lambda item: item[0] in data):
        if key == "layers" and set(value) <= set(old.get(key) or ()):
            continue
        if old.get(key) != value:
            return key
    return None


def shard_range(j: int, rows: int, size: int) -> range:
    """The rows shard ``j`` of a cache of ``rows`` rows holds, ``size`` a shard."""
    return range(j * size, min(rows, (j + 1) * size))


def provenance(recipe_text: str, tokenizer) -> dict:
    """Who made a cache, kept in its manifest for people (a cache serves any recipe with the
    same fingerprint): the recipe (a copy beside the shards, and its sha256) and the
    tokenizer (its name and a hash of its vocabulary; the fingerprint's ``data_sha256`` covers
    its token ids)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {
        "recipe": RECIPE,
        "recipe_sha256": hashlib.sha256(recipe_text.encode()).hexdigest(),
        "tokenizer": {
            "name": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
        },
    }


def build_cache(
    target, dataset, fp: dict, out: Path, batch_size: int, progress=True, recipe_text=None
) -> dict:
    """Cache the teacher of every row of ``dataset`` into ``out``, resuming the shards already
    there. A cache started here with ``recipe_text`` keeps a copy of it and its
    :func:`provenance`. Returns the manifest.

    Raises:
        DataError: ``out`` holds a cache made for something else, or files that are not one,
            or another process is writing it.
    """
    with locked(out):  # two writers would clear each other's shards in progress
        return _build(target, dataset, fp, out, batch_size, progress, recipe_text)


def _build(target, dataset, fp, out: Path, batch_size: int, progress: bool, recipe) -> dict:
    made_by = None if recipe is None else provenance(recipe, target.tokenizer)
    manifest = begin(out, fp, recipe, made_by, dataset)
    fp = manifest["fingerprint"]  # the layers it holds, when more than asked for
    n, size = len(dataset), fp["shard_rows"]
    todo = shards_to_do(out, n, size)
    rows = sum(len(shard_range(j, n, size)) for j in todo)
    estimate = estimate_bytes(dataset, fp)
    logger.info(
        "teacher cache %s: %d rows, %d to do; about %.2f GB in all (%s, top-k %s, layers %s)",
        out, n, rows, estimate / 1e9, fp["dtype"], fp["top_k"] or "full", fp["layers"],
    )  # fmt: skip
    bar = tqdm(total=rows, disable=not progress, desc="cache", unit="row")
    for j in todo:
        tensors = encode_rows(target, dataset, shard_range(j, n, size), fp, batch_size)
        write_shard(out, j, tensors, j * size)
        bar.update(len(shard_range(j, n, size)))
    bar.close()
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    taught = sum(len(teacher_positions(m)) for m in dataset["loss_mask"])
    return finish(out, manifest, math.ceil(n / size), tokens, taught)


def begin(out: Path, fp: dict, recipe: str | None, made_by: dict | None, dataset=None) -> dict:
    """The manifest of the cache ``fp`` in ``out``, marked incomplete until :func:`finish`: the
    one there (checked against ``fp``; grown when ``dataset`` extends its rows, see
    :func:`grown`), or a new one with ``made_by`` beside a copy of ``recipe``. Shards a killed
    run left under their temporary names are cleared."""
    manifest = read_manifest(out, FORMAT)
    bigger = None if manifest is None or dataset is None else grown(manifest, fp, dataset)
    if bigger is not None:
        check_fingerprint(out, {"fingerprint": bigger}, fp)  # grown, and all else the same
        logger.info(
            "teacher cache %s: the data grew from %d to %d rows, the first %d as cached: "
            "the cache grows", out, manifest["fingerprint"]["rows"], fp["rows"],
            manifest["fingerprint"]["rows"],
        )  # fmt: skip
        manifest["fingerprint"] = bigger
    if manifest is None:
        if any(out.glob("shard-*")):
            raise DataError(f"{out} has shards but no {MANIFEST}; use an empty directory")
        manifest = {"format": FORMAT, "fingerprint": fp, "complete": False}
        if recipe is not None:
            write_atomic(out / RECIPE, recipe)
        if made_by is not None:
            manifest["made_by"] = made_by
    check_fingerprint(out, manifest, fp)
    for stale in out.glob("*.tmp"):
        stale.unlink()  # a shard whose run was killed before its rename
    manifest["complete"] = False
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_shard(out: Path, j: int, tensors: dict, start: int) -> None:
    """Shard ``j`` of ``out``: written to a temporary name, fsynced, then renamed."""
    tmp = out / (shard_name(j) + ".tmp")
    save_file(tensors, str(tmp), metadata={"start": str(start)})
    os.chmod(tmp, 0o666 & ~_umask())
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / shard_name(j))


def finish(out: Path, manifest: dict, shards: int, tokens: int, taught: int) -> dict:
    """Mark the cache in ``out`` complete, with its counts; returns the manifest."""
    files = [out / shard_name(j) for j in range(shards)]
    manifest.update(
        complete=True,
        shards=shards,
        tokens=tokens,
        teacher_positions=taught,
        bytes=sum(p.stat().st_size for p in files),
    )
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def top_k_of(log_p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[M, k]`` largest of the ``[M, V]`` log-probabilities ``log_p`` (best first), their
    int32 ids and the ``[M]`` log of the mass left out."""
    top = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
    kept = top.values.exp().sum(-1).clamp(max=1.0)
    rest = torch.log1p(-kept).clamp_min(MIN_LOG_REST)
    return top.values, top.indices.to(torch.int32), rest


def encode_rows(target, dataset, rows: range, fp: dict, batch_size: int) -> dict:
    """The shard tensors of ``rows``: the target runs on batches of similar length."""
    ids = [dataset[i]["input_ids"] for i in rows]
    masks = [dataset[i]["loss_mask"] for i in rows]
    features: list = [None] * len(rows)
    teacher: list = [None] * len(rows)
    by_length = sorted(range(len(rows)), key=lambda r: len(ids[r]))
    for b in range(0, len(rows), batch_size):
        chunk = by_length[b : b + batch_size]
        width = max(len(ids[r]) for r in chunk)
        batch = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, r in enumerate(chunk):
            batch[i, : len(ids[r])] = torch.tensor(ids[r])
            attention[i, : len(ids[r])] = 1
        wanted = torch.zeros(len(chunk), width, dtype=torch.bool)
        for i, r in enumerate(chunk):
            wanted[i, teacher_positions(masks[r])] = True
        with torch.no_grad():
            out = target.forward(batch, attention, hidden_layers=fp["layers"], logits_at=wanted)
            log_p = torch.log_softmax(out.logits.float(), -1)  # [N, V], row-major
            if fp["top_k"]:  # only the top k leave the batch
                parts = tuple(x.cpu() for x in top_k_of(log_p, fp["top_k"]))
            else:
                parts = (log_p.cpu(),)
        start = 0
        for i, r in enumerate(chunk):
            n, where = len(ids[r]), wanted[i].nonzero().squeeze(-1)
            if fp["layers"]:
                layers = [out.hidden_states[h][i, :n] for h in fp["layers"]]
                features[r] = torch.stack(layers, 1).float().cpu()  # [n, L, H]
            teacher[r] = (where, [x[start : start + len(where)] for x in parts])
            start += len(where)
    tensors = {
        "input_ids": torch.tensor([t for row in ids for t in row], dtype=torch.int32),
        "row_offsets": _offsets([len(x) for x in ids]),
        "teacher_offsets": _offsets([len(w) for w, _ in teacher]),
        "teacher_pos": torch.cat([w for w, _ in teacher]).to(torch.int32),
    }
    if fp["layers"]:
        tensors |= named("features", pack(torch.cat(features), fp["dtype"]))
    columns = [torch.cat(c) for c in zip(*(parts for _, parts in teacher), strict=True)]
    if fp["top_k"]:  # [M, k] log-probabilities, their ids, [M] log of the rest
        tensors |= {"ids": columns[1].contiguous(), "rest": columns[2].contiguous()}
    tensors |= named("logp", pack(columns[0], fp["dtype"]))  # [M, k or V]
    return tensors


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def named(name: str, packed: dict) -> dict:
    return {name + suffix: t for suffix, t in packed.items()}
