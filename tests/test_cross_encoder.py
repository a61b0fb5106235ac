"""robustir.models.cross_encoder: the cross-encoder folders a team brings (issue 55, item 2) and the reranker they
serve -- its name in /v1/models and /v1/rerank, its pair budget.

Every folder holds the same tiny random one-label BERT (MiniLM's tokenizer), saved in each layout: by the installed
sentence-transformers' ``CrossEncoder.save`` (``modules.json``), by ``save_pretrained`` (the layout of
sentence-transformers 3 to 5, with and without their ``config.json`` key), and as the Hugging Face cache holds a
download. Servers run on 127.0.0.1 with a free port, in a thread.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import httpx  # noqa: E402  (tests/ is on sys.path)
from test_serving_index import write_beir  # noqa: E402
from robustir.errors import ConfigError
from robustir.models.cross_encoder import CrossEncoder, cross_encoder_name, is_cross_encoder, resolve_cross_encoder
from robustir.index.store import IndexConfig, SearchIndex
from robustir.serving import ServeConfig, create_app, running_server

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PAIRS = [("what does the heart do", "the heart pumps blood"), ("what does the heart do", "coffee is a drink"),
         ("bones", "bones need calcium")]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """The same tiny cross-encoder in every layout robustir takes."""
    import torch
    from sentence_transformers import CrossEncoder as STCrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("cross-layouts")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(3)
    legacy = root / "pretrained"  # save_pretrained: config.json + weights + tokenizer, no modules.json
    BertForSequenceClassification(config).save_pretrained(legacy)
    tokenizer.save_pretrained(legacy)
    v4 = root / "st4"  # sentence-transformers 4 and 5 add their key to config.json
    shutil.copytree(legacy, v4)
    data = json.loads((v4 / "config.json").read_text())
    data["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Sigmoid", "version": "4.1.0"}
    (v4 / "config.json").write_text(json.dumps(data))
    installed = root / "installed"  # the installed sentence-transformers' own save (6.x: modules.json)
    STCrossEncoder(str(legacy), device="cpu").save(str(installed))
    cache = root / "hub"  # the Hugging Face cache's layout of the download of org/tiny-reranker
    repo = cache / "models--org--tiny-reranker"
    shutil.copytree(installed, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return {"pretrained": legacy, "st4": v4, "installed": installed, "cache": cache, "repo": repo,
            "snapshot": repo / "snapshots" / "0123abcd"}


def test_the_installed_sentence_transformers_writes_modules_json(layouts):
    """The layout issue 55 found refused: the installed version's ``CrossEncoder.save`` writes ``modules.json``."""
    assert (layouts["installed"] / "modules.json").is_file()
    assert not (layouts["pretrained"] / "modules.json").exists()


@pytest.mark.parametrize("layout", ["pretrained", "st4", "installed", "snapshot", "repo"])
def test_every_layout_loads_and_scores_as_sentence_transformers_does(layouts, layout):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    expected = STCrossEncoder(str(layouts["pretrained"]), device="cpu").predict(PAIRS)
    model = CrossEncoder(layouts[layout], precision="fp32", device="cpu")
    scores = model.score([q for q, _ in PAIRS], [d for _, d in PAIRS])
    np.testing.assert_allclose(scores, expected, atol=1e-6)
    assert np.all((scores > 0) & (scores < 1))  # the default activation of one label: a sigmoid
    assert model.name == {"pretrained": "pretrained", "st4": "st4", "installed": "installed"}.get(
        layout, "org/tiny-reranker")


def test_a_hub_id_is_read_from_the_local_cache_without_the_network(layouts, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(layouts["cache"]))
    assert resolve_cross_encoder("org/tiny-reranker") == layouts["snapshot"]
    model = CrossEncoder("org/tiny-reranker", precision="fp32", device="cpu")
    assert model.name == "org/tiny-reranker" and model.folder == layouts["snapshot"]


def test_what_is_a_cross_encoder(layouts, tiny_model_dir, minilm_path, tmp_path):
    for layout in ("pretrained", "st4", "installed", "snapshot"):
        assert is_cross_encoder(layouts[layout]), layout
    assert not is_cross_encoder(tiny_model_dir)  # a masked-LM BERT
    assert not is_cross_encoder(minilm_path)  # a sentence-transformers embedding model (modules.json, Pooling)
    with pytest.raises(ConfigError, match="is not a cross-encoder"):
        resolve_cross_encoder(minilm_path)
    two = tmp_path / "models--org--two"  # a cache folder with two snapshots and no refs/main: which one is meant?
    for commit in ("a1", "b2"):
        shutil.copytree(layouts["installed"], two / "snapshots" / commit)
    with pytest.raises(ConfigError, match="2 snapshots and no refs/main"):
        resolve_cross_encoder(two)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_cross_encoder(tmp_path / "no-such-folder")


def test_names():
    assert cross_encoder_name("/c/hub/models--BAAI--bge-reranker-base/snapshots/abc") == "BAAI/bge-reranker-base"
    assert cross_encoder_name("/models/my-reranker") == "my-reranker"
    assert cross_encoder_name("/no/such/folder", "cross-encoder/ms-marco-MiniLM-L-6-v2") == \
        "cross-encoder/ms-marco-MiniLM-L-6-v2"


# ------------------------------------------------------------------------------------------------ served

@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("rerank-serve")
    SearchIndex.build(root / "idx", tiny_model_dir, write_beir(root / "beir"),
                      config=IndexConfig(show_progress=False))[0].close()
    return root / "idx"


def test_the_reranker_is_listed_and_answers_to_its_own_name(layouts, tiny_index):
    """Issue 55: /v1/rerank answered 404 to the name its own responses report, and /v1/models did not list it."""
    app = create_app(None, tiny_index, ServeConfig(rerank_model=str(layouts["snapshot"]), precision="fp32"))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        embedder = app.state.server.name
        assert listed == [embedder, "org/tiny-reranker"]
        assert client.get("/v1/models/org/tiny-reranker").json()["id"] == "org/tiny-reranker"
        body = {"query": "heart", "documents": ["the heart pumps blood", "coffee"], "model": "org/tiny-reranker"}
        reply = client.post("/v1/rerank", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "org/tiny-reranker"
        assert client.post("/v1/rerank", json={**body, "model": embedder}).status_code == 200
        missing = client.post("/v1/rerank", json={**body, "model": "someone/else"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "the reranker 'org/tiny-reranker'" in missing.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"input": "x", "model": "org/tiny-reranker"}).status_code == 404


def test_the_rerank_pair_budget(layouts, tiny_index):
    """/v1/rerank's documents and /search's queries x rerank_candidates are bounded by --max-rerank-pairs."""
    config = ServeConfig(rerank_model=str(layouts["installed"]), precision="fp32", rerank_candidates=4,
                         max_rerank_pairs=8)
    app = create_app(None, tiny_index, config)
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/rerank", json={"query": "q", "documents": ["d"] * 8}).status_code == 200
        over = client.post("/v1/rerank", json={"query": "q", "documents": ["d"] * 9})
        assert over.status_code == 400 and "at most 8" in over.json()["error"]["message"]
        assert "--max-rerank-pairs" in over.json()["error"]["message"], over.text  # the setting that bounds it
        fits = client.post("/search", json={"query": ["heart", "coffee"], "top_k": 2, "rerank": True})
        assert fits.status_code == 200, fits.text
        assert all("rerank_score" in hit for row in fits.json()["hits"] for hit in row)
        refused = client.post("/search", json={"query": ["a", "b", "c"], "top_k": 2, "rerank": True})
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "rerank"
        assert message.startswith("'rerank' with 3 queries x 4 rerank candidates is 12 pairs for the reranker; at "
                                  "most 8 per request (--max-rerank-pairs): send at most 2 queries"), message
        # a top_k over --rerank-candidates re-scores top_k hits a query: counted so (it went past the budget unseen)
        deep = client.post("/search", json={"query": ["a", "b"], "top_k": 5, "rerank": True})
        assert deep.status_code == 400 and "2 queries x 5 hits (top_k) is 10 pairs" in deep.json()["error"]["message"], \
            deep.text
        # without rerank the same request is no reranker work
        assert client.post("/search", json={"query": ["a", "b", "c"], "top_k": 2}).status_code == 200
    with pytest.raises(ConfigError, match="rerank_candidates 20 is over max_rerank_pairs 8"):
        ServeConfig(rerank_candidates=20, max_rerank_pairs=8).validate()


def test_the_teacher_filter_takes_the_same_folders(layouts):
    """``robustir filter --method teacher`` scores with the same class: the installed layout is recognised (auto), and
    a Hugging Face cache folder is taken as a cross-encoder teacher."""
    from robustir.filtering.teacher import load_teacher

    auto = load_teacher(str(layouts["installed"]), precision="fp32", device="cpu")
    cached = load_teacher(str(layouts["repo"]), "cross-encoder", precision="fp32", device="cpu")
    assert type(auto) is CrossEncoder and type(cached) is CrossEncoder
    np.testing.assert_allclose(auto.score(["q"], ["a passage"]), cached.score(["q"], ["a passage"]), atol=1e-6)
