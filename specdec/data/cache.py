"""The target's teacher, cached: one pass of the frozen target over the training data, read back
by training instead of running the target on every batch (``data.teacher: cache``).

What a row stores:
- the hidden states of the layers the drafter reads, at every position;
- the target's next-token log-probabilities where a loss needs them: at position t when token
  t + 1 is an assistant token (every drafter step's teacher row is such a position, see
  ``Drafter.teacher``); over the full vocabulary (``top_k: 0``) or as the top k with their
  ids and the log of the remaining mass.

Read back (:meth:`TeacherCache.batch`), a full row is the stored distribution; a top-k row is
the target's distribution on its k most likely tokens with the remaining mass spread evenly
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
                              run leaves whole shards only and resumes with the missing ones
"""

from __future__ import annotations

import hashlib
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
from specdec.sparse_teacher import SparseTeacher

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
    data = hashlib.sha256()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        data.update(json.dumps([ids, mask]).encode())
    return {
        "target": {
            "dtype": target_cfg.dtype,
            "config_sha256": hashlib.sha256(
                json.dumps(config, sort_keys=True).encode()
            ).hexdigest(),
            "weight_sum": f"{checksum:.8g}",
        },
        "data_sha256": data.hexdigest(),
        "rows": len(dataset),
        "layers": [int(i) for i in layers],
        "top_k": int(cfg.top_k),
        "dtype": cfg.dtype,
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.model.config.hidden_size),
        "shard_rows": int(cfg.shard_rows),
    }


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
    """Raise DataError naming the first thing ``out`` was cached for that differs from now; a
    cache of more layers than asked for serves (one cache for drafters that read fewer).
    ``where`` names the setting that pointed at ``out``; ``hint``, what to do instead."""
    old = manifest.get("fingerprint", {})
    for key, value in fp.items():
        if key == "layers" and set(value) <= set(old.get(key) or ()):
            continue
        if old.get(key) != value:
            raise DataError(
                f"{where}: {out} holds a teacher cache of another {key} "
                f"({old.get(key)!r} there, {value!r} now); "
                + (hint or "use another data.cache.dir or delete that one")
            )


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
    manifest = begin(out, fp, recipe, made_by)
    fp = manifest["fingerprint"]  # the layers it holds, when more than asked for
    n, size = len(dataset), fp["shard_rows"]
    todo = [j for j in range(math.ceil(n / size)) if not (out / shard_name(j)).exists()]
    rows = sum(min(n, (j + 1) * size) - j * size for j in todo)
    estimate = estimate_bytes(dataset, fp)
    logger.info(
        "teacher cache %s: %d rows, %d to do; about %.2f GB in all (%s, top-k %s, layers %s)",
        out, n, rows, estimate / 1e9, fp["dtype"], fp["top_k"] or "full", fp["layers"],
    )  # fmt: skip
    bar = tqdm(total=rows, disable=not progress, desc="cache", unit="row")
    for j in todo:
        tensors = encode_rows(
            target, dataset, range(j * size, min(n, (j + 1) * size)), fp, batch_size
        )
        write_shard(out, j, tensors, j * size)
        bar.update(min(n, (j + 1) * size) - j * size)
    bar.close()
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    taught = sum(len(teacher_positions(m)) for m in dataset["loss_mask"])
    return finish(out, manifest, math.ceil(n / size), tokens, taught)


def begin(out: Path, fp: dict, recipe: str | None, made_by: dict | None) -> dict:
    """The manifest of the cache ``fp`` in ``out``, marked incomplete until :func:`finish`: the
    one there (checked against ``fp``), or a new one with ``made_by`` beside a copy of
    ``recipe``. Shards a killed run left under their temporary names are cleared."""
    manifest = read_manifest(out, FORMAT)
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


class TeacherCache:
    """A complete cache, read row by row from memory-mapped shards.

    Args:
        out: the cache directory.
        fp: the fingerprint it must have been made for.
        draft_ids: ``[D]`` the drafter's vocabulary as target ids, for :meth:`batch` (None:
            the target's vocabulary).
    """

    def __init__(self, out: Path, fp: dict, draft_ids: torch.Tensor | None = None):
        manifest = read_manifest(out, FORMAT)
        if manifest is None or not manifest.get("complete"):
            raise DataError(f"data.cache.dir: {out} holds no complete teacher cache")
        check_fingerprint(out, manifest, fp)
        self.fp, self.out, self.draft_ids = manifest["fingerprint"], out, draft_ids
        self.layers = [self.fp["layers"].index(h) for h in fp["layers"]]  # those asked for
        self.shards, self.offsets = [], []
        for j in range(manifest["shards"]):
            try:
                handle = safe_open(str(out / shard_name(j)), framework="pt")
                offsets = (handle.get_tensor("row_offsets"), handle.get_tensor("teacher_offsets"))
            except Exception as err:  # a truncated or foreign file: one line, not a traceback
                path = out / shard_name(j)
                raise DataError(f"{path}: unreadable teacher shard ({err})") from None
            self.shards.append(handle)
            self.offsets.append(offsets)

    def row(self, index: int) -> dict:
        """Row ``index``: ``input_ids`` [n], ``features`` [n, L, H] of the layers asked for
        (if any), the teacher's ``positions`` [m] and their log-probabilities ``log_p``
        [m, V] (top-k rows filled)."""
        out, (values, ids, fill) = self._read(index)
        if ids is not None:
            values = SparseTeacher(values, ids, fill, self.fp["vocab_size"]).dense()
        out["log_p"] = values
        return out

    def _read(self, index: int) -> tuple[dict, tuple]:
        """Row ``index`` as stored: its tokens, positions and features, and the teacher as
        ``(values [m, k or V], ids [m, k] or None, tail log-probability [m] or None)``."""
        j, r = divmod(index, self.fp["shard_rows"])
        shard, (rows, taught) = self.shards[j], self.offsets[j]
        a, b = int(rows[r]), int(rows[r + 1])
        c, d = int(taught[r]), int(taught[r + 1])
        out = {
            "input_ids": shard.get_slice("input_ids")[a:b].long(),
            "positions": shard.get_slice("teacher_pos")[c:d].long(),
        }
        if self.layers:
            features = shard.get_slice("features")[a:b]
            out["features"] = unpack(features, self._scale(shard, "features", a, b))[:, self.layers]
        values = unpack(shard.get_slice("logp")[c:d], self._scale(shard, "logp", c, d))
        k, vocab = self.fp["top_k"], self.fp["vocab_size"]
        if not k:
            return out, (values, None, None)
        rest = shard.get_slice("rest")[c:d]
        fill = rest - math.log(vocab - k) if k < vocab else torch.full_like(rest, -math.inf)
        return out, (values, shard.get_slice("ids")[c:d].long(), fill)

    def _scale(self, shard, name: str, a: int, b: int) -> torch.Tensor | None:
        return shard.get_slice(name + "_scale")[a:b] if self.fp["dtype"] == "fp8" else None

    def batch(self, indices: list[int], width: int, input_ids: torch.Tensor) -> dict:
        """The teacher of a micro-batch padded to ``width``, over the drafter's vocabulary, at
        the N positions ``teacher_rows`` [B, width] sets (those whose next token is an
        answer's), in their row-major order: ``teacher_log_probs`` [N, D] (what
        ``Drafter.teacher`` computes from the target's logits, built without them; a
        :class:`SparseTeacher` of them from a top-k cache),
        ``teacher_best`` [N] (the target's top token as a draft index, -1: outside the draft
        vocabulary); and ``features`` [L, B, width, H] when the drafter reads layers.

        Raises:
            DataError: a row's tokens differ from the training data's (a cache of other data).
        """
        vocab = self.fp["vocab_size"]
        draft = torch.arange(vocab) if self.draft_ids is None else self.draft_ids.cpu().long()
        index = torch.full((vocab,), -1, dtype=torch.long)
        index[draft] = torch.arange(len(draft))
        taught = torch.zeros(len(indices), width, dtype=torch.bool)
        log_p, best, cols, fills = [], [], [], []
        layers, hidden = len(self.layers), self.fp["hidden_size"]
        features = torch.zeros(layers, len(indices), width, hidden) if layers else None
        for b, i in enumerate(indices):
            row, (values, ids, fill) = self._read(i)
            n, where = len(row["input_ids"]), row["positions"]
            if not torch.equal(row["input_ids"], input_ids[b, :n].cpu()):
                raise DataError(f"{self.out}: row {i} holds other tokens than the training data")
            taught[b, where] = True  # positions ascend: row-major order
            if ids is None:  # the full vocabulary
                best.append(index[values.argmax(-1)])
                log_p.append(values[:, draft])
            else:  # the top k (best first) as draft indices, the rest spread evenly
                best.append(index[ids[:, 0]])
                col = index[ids]
                log_p.append(torch.where(col >= 0, values, -math.inf))
                cols.append(col.clamp_min(0))
                fills.append(fill)
            if features is not None:
                features[:, b, :n] = row["features"].transpose(0, 1)
        teacher = torch.cat(log_p)
        if cols:  # kept sparse: no [N, D] tensor is built for the losses that read it so
            teacher = SparseTeacher(teacher, torch.cat(cols), torch.cat(fills), len(draft))
        out = {"teacher_log_probs": teacher, "teacher_best": torch.cat(best)}
        out["teacher_rows"] = taught
        if features is not None:
            out["features"] = features
        return out
