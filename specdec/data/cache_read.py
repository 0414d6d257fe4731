"""A complete teacher cache read back: memory-mapped shards, row by row and in batches over the
drafter's vocabulary (the layout and what a row stores: :mod:`specdec.data.cache`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.data.cache import FORMAT, check_fingerprint, shard_name, shard_range, unpack
from specdec.data.shards import read_manifest
from specdec.errors import DataError
from specdec.sparse_teacher import SparseTeacher


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
            held = len(offsets[0]) - 1
            want = len(shard_range(j, self.fp["rows"], self.fp["shard_rows"]))
            if held != want:  # a grown cache's old last shard, left by a killed run
                raise DataError(
                    f"{out / shard_name(j)}: {held} rows where this cache's shard holds {want}; "
                    "build it again (specdec data cache) to finish it"
                )
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
        the N positions ``teacher_rows`` [B, width] sets (those whose next token the cached
        row teaches: an answer's, any under ``data.loss_on: all``; a row's own ``loss_mask``
        picks those it trains), in their row-major order: ``teacher_log_probs`` [N, D] (what
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
