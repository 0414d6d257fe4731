"""A teacher cache derived from another without the target: fewer top-k log-probabilities, a
narrower storage dtype, fewer layers (``specdec data cache --from DIR``).

One pass of the target over the data (a full-vocabulary cache, say) then serves every storage
choice to compare: each derived cache holds what a build of that choice would hold from the
source's values. From a float32 source that is exactly what the build writes (same top k, same
remaining mass, same packing); from a float16 source the top k are chosen and the remaining
mass summed from the float16 values (their rounding, about 5e-4 relative, on top of the
choice's own).

What cannot be derived is refused: a full vocabulary or a larger k from a top-k source, a dtype
more precise than the source's (only float32 narrows to any dtype, and anything to fp8), layers
or data the source lacks.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from specdec.data.cache import (
    FORMAT,
    MIN_LOG_REST,
    RECIPE,
    begin,
    check_fingerprint,
    finish,
    named,
    pack,
    shard_name,
    shards_to_do,
    top_k_of,
    unpack,
    write_shard,
)
from specdec.data.shards import locked, read_manifest
from specdec.errors import DataError

_COPIED = ("input_ids", "row_offsets", "teacher_offsets", "teacher_pos")


def source_manifest(source: Path) -> dict:
    """The manifest of the complete cache ``source`` (read before any model loads)."""
    have = read_manifest(Path(source), FORMAT)
    if have is None or not have.get("complete"):
        raise DataError(f"--from: {source} holds no complete teacher cache")
    return have


def check_derivable(source: Path, src: dict, fp: dict) -> None:
    """Raise DataError when the cache ``source`` (fingerprint ``src``) cannot give ``fp``."""
    storage = {"top_k": src["top_k"], "dtype": src["dtype"]}
    hint = "derive from a cache of this recipe's target, data and layers"
    check_fingerprint(source, {"fingerprint": src}, {**fp, **storage}, "--from", hint)
    k, have = fp["top_k"], src["top_k"]
    if have and (not k or k > have):
        want = f"top-k {k}" if k else "the full vocabulary"
        raise DataError(
            f"--from: {source} keeps the target's top {have} log-probabilities only; "
            f"{want} needs a build from the target (drop --from)"
        )
    if fp["dtype"] not in (src["dtype"], "fp8") and src["dtype"] != "float32":
        raise DataError(
            f"--from: {source} stores {src['dtype']}; a {fp['dtype']} cache from it would hold "
            f"{src['dtype']} values (derive float32 or fp8 sources, or drop --from)"
        )


def derive_cache(source: Path, fp: dict, out: Path, progress=True, recipe_text=None) -> dict:
    """Write the cache ``fp`` describes into ``out`` from the complete cache ``source``, shard
    by shard, resuming the shards already there. Returns the manifest.

    Raises:
        DataError: ``source`` is no complete cache or cannot give ``fp``
            (:func:`check_derivable`), or ``out`` holds another cache or is being written.
    """
    if Path(out).resolve() == Path(source).resolve():
        raise DataError(f"--from: {source} is data.cache.dir itself; derive into another one")
    have = source_manifest(source)
    check_derivable(source, have["fingerprint"], fp)
    made_by = {"derived_from": str(source), "source_made_by": have.get("made_by")}
    if recipe_text is not None:
        made_by["recipe"] = RECIPE
    with locked(out):
        manifest = begin(out, fp, recipe_text, made_by)
        fp = manifest["fingerprint"]  # the layers it holds, when more than asked for
        check_derivable(source, have["fingerprint"], fp)
        todo = shards_to_do(out, fp["rows"], fp["shard_rows"])
        for j in tqdm(todo, disable=not progress, desc="derive", unit="shard"):
            with safe_open(str(source / shard_name(j)), framework="pt") as shard:
                tensors = transcode(shard, have["fingerprint"], fp)
                start = int(shard.metadata()["start"])
            write_shard(out, j, tensors, start)
        return finish(out, manifest, have["shards"], have["tokens"], have["teacher_positions"])


def transcode(shard, src: dict, fp: dict) -> dict:
    """The tensors of one shard of the ``fp`` cache from the open shard of the ``src`` one."""
    tensors = {name: shard.get_tensor(name) for name in _COPIED}
    if fp["layers"]:
        pick = [src["layers"].index(h) for h in fp["layers"]]
        features = unpack(shard.get_tensor("features"), _scale(shard, src, "features"))
        tensors |= named("features", pack(features[:, pick].contiguous(), fp["dtype"]))
    values = unpack(shard.get_tensor("logp"), _scale(shard, src, "logp"))  # [M, K or V]
    if fp["top_k"]:
        if not src["top_k"]:  # the full vocabulary: what the build keeps of it
            values, ids, rest = top_k_of(values, fp["top_k"])
        else:  # the k best of the K kept; what they leave joins the remaining mass
            top = values.topk(fp["top_k"], dim=-1)
            ids = shard.get_tensor("ids").gather(-1, top.indices)
            dropped = values.scatter(-1, top.indices, -math.inf)
            rest = torch.logaddexp(shard.get_tensor("rest"), dropped.logsumexp(-1))
            values, rest = top.values, rest.clamp(MIN_LOG_REST, 0.0)
        tensors |= {"ids": ids.contiguous(), "rest": rest.contiguous()}
    return tensors | named("logp", pack(values.contiguous(), fp["dtype"]))


def _scale(shard, src: dict, name: str) -> torch.Tensor | None:
    return shard.get_tensor(name + "_scale") if src["dtype"] == "fp8" else None
