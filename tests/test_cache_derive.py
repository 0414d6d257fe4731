"""A teacher cache derived from another (``specdec data cache --from``) against the cache the
target's own pass builds for the same choice."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_cache import (  # noqa: F401
    LAYERS,
    ROOT,
    command_sets,
    files,
    make,
    rows,
    shards,
    spec,
    target,
)

from specdec.data.cache import fingerprint
from specdec.data.cache_derive import derive_cache
from specdec.data.cache_read import TeacherCache
from specdec.errors import DataError


def fp_of(target, data, layers=LAYERS, **kw) -> dict:  # noqa: F811
    return fingerprint(target, SimpleNamespace(dtype="float32"), data, layers, spec(**kw))


@pytest.mark.parametrize(
    ("top_k", "dtype", "layers"),
    [(8, "float32", LAYERS), (8, "fp8", (1,)), (0, "float16", LAYERS), (0, "fp8", (0,))],
)
def test_derived_from_a_float32_full_cache_is_the_build_of_that_choice(
    target,  # noqa: F811
    tmp_path,
    top_k,
    dtype,
    layers,
):
    data = rows(n=8)
    make(target, data, tmp_path / "full")  # float32, full vocabulary, both layers
    make(target, data, tmp_path / "built", layers=layers, top_k=top_k, dtype=dtype)
    fp = fp_of(target, data, layers, top_k=top_k, dtype=dtype)
    manifest = derive_cache(tmp_path / "full", fp, tmp_path / "derived", progress=False)
    built, derived = shards(tmp_path / "built"), shards(tmp_path / "derived")
    assert built.keys() == derived.keys() and len(built) == 3
    for name, tensors in built.items():
        assert tensors.keys() == derived[name].keys(), name
        for key, value in tensors.items():  # the same bytes: the same values, the same dtype
            assert derived[name][key].dtype == value.dtype, (name, key)
            assert torch.equal(derived[name][key].view(torch.uint8), value.view(torch.uint8))
    assert manifest["fingerprint"] == fp and manifest["complete"]
    assert manifest["made_by"]["derived_from"] == str(tmp_path / "full")
    TeacherCache(tmp_path / "derived", fp).row(5)  # serves the recipe it was derived for


def test_derived_from_a_top_k_cache_keeps_its_best_and_adds_the_rest_to_the_tail(
    target,  # noqa: F811
    tmp_path,
):
    data = rows(n=8)
    make(target, data, tmp_path / "top16", top_k=16)
    make(target, data, tmp_path / "built", top_k=4)
    fp = fp_of(target, data, top_k=4)
    derive_cache(tmp_path / "top16", fp, tmp_path / "derived", progress=False)
    built, derived = shards(tmp_path / "built"), shards(tmp_path / "derived")
    for name, tensors in built.items():
        for key in ("ids", "logp", "features", "input_ids", "teacher_pos", "teacher_offsets"):
            assert torch.equal(derived[name][key], tensors[key]), (name, key)
        # the build sums what it keeps, the derivation what it drops: float rounding apart
        torch.testing.assert_close(derived[name]["rest"], tensors["rest"], atol=2e-5, rtol=0)
        assert (tensors["rest"] > torch.log(torch.tensor(1e-3))).any()  # a tail worth checking


def test_an_fp8_source_is_read_with_its_scales(target, tmp_path):  # noqa: F811
    """fp8 from fp8 (top 4 of 8, one layer of two): within two roundings of the target."""
    data = rows(n=5)
    make(target, data, tmp_path / "exact")  # float32, full vocabulary
    make(target, data, tmp_path / "fp8", top_k=8, dtype="fp8")
    fp = fp_of(target, data, (1,), top_k=4, dtype="fp8")
    derive_cache(tmp_path / "fp8", fp, tmp_path / "out", progress=False)
    for name, got in shards(tmp_path / "out").items():
        exact = load_file(tmp_path / "exact" / name)
        true = exact["logp"].gather(-1, got["ids"].long())  # at the ids it kept
        read = got["logp"].float() * got["logp_scale"][:, None]  # e4m3 values times scales
        torch.testing.assert_close(read, true, rtol=0.13, atol=1e-2)
        want = exact["features"][:, 1:]
        feats = got["features"].float() * got["features_scale"][..., None]
        assert ((feats - want).abs().amax(-1) <= 0.13 * want.abs().amax(-1)).all()


def test_a_derived_cache_resumes_with_its_missing_shards(target, tmp_path):  # noqa: F811
    data = rows(n=8)
    make(target, data, tmp_path / "full")
    fp = fp_of(target, data, top_k=8, dtype="fp8")
    out = tmp_path / "derived"
    derive_cache(tmp_path / "full", fp, out, progress=False)
    whole = shards(out)
    (out / "shard-00001.safetensors").unlink()  # killed before that shard, one half-written
    (out / "shard-00002.safetensors").rename(out / "shard-00002.safetensors.tmp")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    kept = (out / "shard-00000.safetensors").stat().st_mtime_ns
    derive_cache(tmp_path / "full", fp, out, progress=False)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == kept
    assert not list(out.glob("*.tmp"))
    again = shards(out)
    for name, tensors in whole.items():
        for key, value in tensors.items():
            assert torch.equal(again[name][key].view(torch.uint8), value.view(torch.uint8))


def test_what_cannot_be_derived_is_refused_naming_the_source(target, tmp_path):  # noqa: F811
    data = rows(n=5)
    make(target, data, tmp_path / "top8", top_k=8)
    make(target, data, tmp_path / "half", top_k=0, dtype="float16", layers=(1,))

    def refused(source, **kw) -> str:
        fp = fp_of(target, data, kw.pop("layers", LAYERS), **kw)
        with pytest.raises(DataError) as err:
            derive_cache(tmp_path / source, fp, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("shard-*"))
        return str(err.value)

    assert "keeps the target's top 8" in refused("top8", top_k=0)
    assert "top-k 16 needs a build" in refused("top8", top_k=16)
    assert "stores float16; a float32 cache" in refused("half", top_k=0, layers=(1,))
    assert "stores float16; a bfloat16" in refused("half", top_k=8, dtype="bfloat16", layers=(1,))
    assert "another layers" in refused("half", top_k=8, dtype="fp8")
    assert "holds no complete teacher cache" in refused("nothing", top_k=4)
    other = rows(n=5, seed=1)
    fp = fp_of(target, other, top_k=4)
    with pytest.raises(DataError, match=r"^--from: .* another data_sha256"):
        derive_cache(tmp_path / "top8", fp, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="is data.cache.dir itself"):
        derive_cache(tmp_path / "top8", fp_of(target, data, top_k=4), tmp_path / "top8")
    # what can be: fewer layers and fp8 from float16, and the top 8 kept as they are
    derive_cache(tmp_path / "half", fp_of(target, data, (1,), top_k=4, dtype="fp8"),
                 tmp_path / "ok1", progress=False)  # fmt: skip
    derive_cache(tmp_path / "top8", fp_of(target, data, (0,), top_k=8), tmp_path / "ok2",
                 progress=False)  # fmt: skip
    for j in range(2):
        a = load_file(tmp_path / "top8" / f"shard-0000{j}.safetensors")
        b = load_file(tmp_path / "ok2" / f"shard-0000{j}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in ("ids", "logp", "rest"))
        assert torch.equal(a["features"][:, :1], b["features"])


def test_cache_command_derives_from_another_cache_in_one_line(files, tmp_path, capsys):  # noqa: F811
    from specdec.cli import main

    sets = command_sets(files, tmp_path)
    recipe = str(ROOT / "recipes" / "debug" / "tiny_eagle3.yaml")
    full = ["data.cache.top_k=0", "data.cache.dtype=float32", f"data.cache.dir={tmp_path / 'f'}"]
    assert main(["data", "cache", "--config", recipe, "--set", *sets, *full]) == 0
    lossy = ["data.cache.top_k=4", "data.cache.dtype=fp8", f"data.cache.dir={tmp_path / 'l'}"]
    built = ["data.cache.top_k=4", "data.cache.dtype=fp8", f"data.cache.dir={tmp_path / 'b'}"]
    assert main(["data", "cache", "--config", recipe, "--set", *sets, *built]) == 0
    capsys.readouterr()
    argv = ["data", "cache", "--config", recipe, "--from", str(tmp_path / "f"), "--set", *sets]
    assert main([*argv, *lossy]) == 0
    assert "top-k 4, fp8" in capsys.readouterr().out
    b, d = shards(tmp_path / "b"), shards(tmp_path / "l")
    assert b.keys() == d.keys()
    for name in b:
        assert all(torch.equal(d[name][k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in b[name].items())  # fmt: skip
    assert (tmp_path / "l" / "recipe.yaml").exists()
    # a full vocabulary from a top-4 cache, a missing source: one line each, exit 2
    wrong = ["data.cache.top_k=0", f"data.cache.dir={tmp_path / 'w'}"]
    argv = ["data", "cache", "--config", recipe, "--from", str(tmp_path / "l"), "--set", *sets]
    assert main([*argv, *wrong]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("specdec: error: --from: ") and "top 4" in err
    missing = ["data", "cache", "--config", recipe, "--from", str(tmp_path / "none"), "--set"]
    assert main([*missing, *sets, *lossy]) == 2
    assert "holds no complete teacher cache" in capsys.readouterr().err


def test_resuming_a_cache_of_more_layers_keeps_them_in_every_shard(target, tmp_path):  # noqa: F811
    """A drafter reading fewer layers resumes a derived cache of more: the shards it adds hold
    the cache's layers, not its own, as the build's do."""
    data = rows(n=8)
    make(target, data, tmp_path / "full")
    out = tmp_path / "derived"
    derive_cache(tmp_path / "full", fp_of(target, data, top_k=8), out, progress=False)
    whole = shards(out)
    (out / "shard-00001.safetensors").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    again = derive_cache(tmp_path / "full", fp_of(target, data, (1,), top_k=8), out, False)
    assert again["fingerprint"]["layers"] == list(LAYERS)
    resumed = shards(out)["shard-00001.safetensors"]
    assert torch.equal(resumed["features"], whole["shard-00001.safetensors"]["features"])
