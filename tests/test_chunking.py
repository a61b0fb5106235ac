"""Sentence splitting and chunking: exact offsets, full coverage, token budget, resume, clear errors."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from robustir.data.chunking import ChunkConfig, WordCounter, chunk_corpus, chunk_document, make_counter
from robustir.data.documents import DocumentOutput, read_documents
from robustir.data.cjk import cjk_share, is_cjk
from robustir.data.sentences import split_sentences
from robustir.errors import DataError
from robustir.io import Shard

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def sentences(text: str) -> list[str]:
    return [text[s:e] for s, e in split_sentences(text)]


def assert_spans_tile(text: str, spans: list[tuple[int, int]]) -> None:
    """Spans are sorted, disjoint, trimmed, and only whitespace lies between them."""
    pos = 0
    for start, end in spans:
        assert pos <= start < end <= len(text)
        assert text[pos:start].strip() == ""
        assert text[start:end] == text[start:end].strip()
        pos = end
    assert text[pos:].strip() == ""


# ------------------------------------------------------------------------------------------- sentences

@pytest.mark.parametrize("text, expected", [
    ("Smith et al. (2019) measured it. It works, e.g. in mice. Results vary.",
     ["Smith et al. (2019) measured it.", "It works, e.g. in mice.", "Results vary."]),
    ("See Fig. 2 and Eq. 3. The value was 3.5 mm. Done!",
     ["See Fig. 2 and Eq. 3.", "The value was 3.5 mm.", "Done!"]),
    ("J. K. Rowling wrote it. Did she? \"Yes.\" Then Dr. Who arrived, i.e. late.",
     ["J. K. Rowling wrote it.", "Did she?", "\"Yes.\"", "Then Dr. Who arrived, i.e. late."]),
    ("No terminator at the end", ["No terminator at the end"]),
    ("And so on… and then. He left… She stayed.", ["And so on… and then.", "He left…", "She stayed."]),
    ("Line one\nline two. Three\n\n  Four.  ", ["Line one", "line two.", "Three", "Four."]),
])
def test_english_sentences(text: str, expected: list[str]) -> None:
    assert sentences(text) == expected
    assert_spans_tile(text, split_sentences(text))


@pytest.mark.parametrize("text, expected", [
    ("今天天气很好。我们去公园吧！你去吗？", ["今天天气很好。", "我们去公园吧！", "你去吗？"]),
    ("他说：“你好！”我很高兴。", ["他说：", "“你好！”", "我很高兴。"]),
    ("真的吗？！是的……好吧；再见", ["真的吗？！", "是的……", "好吧；", "再见"]),
    ("「走吧。」她说。", ["「走吧。」", "她说。"]),
    ("你好!我很好?是的。", ["你好!", "我很好?", "是的。"]),
    ("第一行\n第二行。第三句", ["第一行", "第二行。", "第三句"]),
    ("版本3.5发布了。", ["版本3.5发布了。"]),
])
def test_chinese_sentences(text: str, expected: list[str]) -> None:
    assert sentences(text) == expected
    assert_spans_tile(text, split_sentences(text))


def test_cjk_helpers() -> None:
    assert is_cjk("中") and is_cjk("。") and is_cjk("カ") and is_cjk("한") and is_cjk("\U00020000")
    assert not is_cjk("a") and not is_cjk("1") and not is_cjk(" ")
    assert cjk_share("") == 0.0 and cjk_share("...") == 0.0
    assert cjk_share("中文 ab") == pytest.approx(0.5) and cjk_share("北京 is big") == pytest.approx(2 / 7)
    assert cjk_share("中文。!") == 1.0  # punctuation counts neither way


def test_every_stage_uses_the_one_cjk_definition() -> None:
    from robustir.index.bm25 import split_words
    from robustir.queries.pairs import char_weight

    assert split_words("한국 data") == ["한", "국", "한국", "data"]  # Hangul is CJK for BM25 too
    assert char_weight("ᄀ") == 1.0 and char_weight("Ⰰ") == 0.3  # Jamo counts as CJK, Glagolitic does not


def test_empty_and_whitespace() -> None:
    assert split_sentences("") == []
    assert split_sentences(" \n\t ") == []
    assert chunk_document("d", "", "  \n ") == []


# ------------------------------------------------------------------------------------------- chunking

def _first_docs(path: Path, n: int = 50) -> list[dict]:
    if not path.exists():
        pytest.skip(f"{path} not present")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in islice(handle, n)]


def _check_passages(text: str, passages: list, counter, max_tokens: int) -> None:
    covered = bytearray(len(text))
    for p in passages:
        assert p.text == text[p.start:p.end]
        assert p.text == p.text.strip() and p.text
        assert len(counter.token_spans(p.text)) <= max_tokens
        covered[p.start:p.end] = b"\x01" * (p.end - p.start)
    missing = [i for i, ch in enumerate(text) if not covered[i] and not ch.isspace()]
    assert not missing, f"characters not in any passage: {[text[i] for i in missing[:10]]}"


@pytest.mark.parametrize("corpus", ["scifact", "cmrc2018-trial"])
@pytest.mark.parametrize("max_tokens, overlap", [(48, 1), (200, 0), (7, 2)])
def test_coverage_and_budget_on_real_text(corpus: str, max_tokens: int, overlap: int) -> None:
    counter = WordCounter()
    for doc in _first_docs(SHARED_DATA / corpus / "corpus.jsonl"):
        passages = chunk_document(doc["_id"], doc["title"], doc["text"], counter, max_tokens=max_tokens,
                                  overlap_sentences=overlap, min_tokens=max_tokens // 4)
        _check_passages(doc["text"], passages, counter, max_tokens)
        assert [p.id for p in passages] == [f"{doc['_id']}#{n}" for n in range(len(passages))]


def test_hf_tokenizer_budget(minilm_path: str) -> None:
    docs = _first_docs(SHARED_DATA / "scifact" / "corpus.jsonl", 10) + \
        _first_docs(SHARED_DATA / "cmrc2018-trial" / "corpus.jsonl", 10)
    counter = make_counter(minilm_path)
    for doc in docs:
        passages = chunk_document(doc["_id"], doc["title"], doc["text"], counter, max_tokens=40)
        _check_passages(doc["text"], passages, counter, 40)


def test_long_sentence_is_cut_exactly() -> None:
    text = "word " * 30 + "end.  Short one.\n" + "长" * 25 + "。"
    passages = chunk_document("d", "t", text, max_tokens=8, overlap_sentences=0, min_tokens=0)
    _check_passages(text, passages, WordCounter(), 8)
    assert all(len(WordCounter().token_spans(p.text)) == 8 for p in passages[:3])


def test_overlap_and_min_tokens() -> None:
    text = "One two three. Four five six. Seven eight nine. Ten."
    plain = chunk_document("d", "", text, max_tokens=6, overlap_sentences=0, min_tokens=0)
    assert [p.text for p in plain] == ["One two three. Four five six.", "Seven eight nine. Ten."]
    overlapped = chunk_document("d", "", text, max_tokens=6, overlap_sentences=1, min_tokens=0)
    assert [p.text for p in overlapped] == ["One two three. Four five six.", "Four five six. Seven eight nine.",
                                            "Seven eight nine. Ten."]
    tail = chunk_document("d", "", "A b c d e. F g h i j. K.", max_tokens=6, overlap_sentences=0, min_tokens=3)
    assert [p.text for p in tail] == ["A b c d e.", "F g h i j. K."]


# ------------------------------------------------------------------------------------------ corpus I/O

def _write_corpus(path: Path, n: int = 12) -> None:
    rows = []
    for i in range(n):
        text = " ".join(f"Sentence {k} of document {i} is here." for k in range(i % 5)) or "   "
        rows.append(json.dumps({"_id": f"doc{i}", "title": f"T{i}", "text": text}))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_resume_after_crash_is_identical(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    clean = tmp_path / "clean.jsonl"
    chunk_corpus(corpus, clean, ChunkConfig(max_tokens=12))

    out = tmp_path / "out.jsonl"
    crashing = 0

    def crash_after_five(docs):
        nonlocal crashing
        for doc in docs:
            crashing += 1
            if crashing > 5:
                raise KeyboardInterrupt
            yield doc

    with pytest.raises(KeyboardInterrupt):
        chunk_corpus(corpus, out, ChunkConfig(max_tokens=12), progress=crash_after_five)
    partial = out.with_name(out.name + ".partial")
    assert partial.exists() and not out.exists()
    # Simulate a crash mid-document: a record of an unfinished document and a torn line.
    with open(partial, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"_id": "doc7#0", "doc_id": "doc7", "title": "", "text": "x",
                                 "start": 0, "end": 1}) + "\n{\"_id\": \"do")
    stats = chunk_corpus(corpus, out, ChunkConfig(max_tokens=12))
    assert stats.skipped_done == 5
    assert out.read_bytes() == clean.read_bytes()
    assert not partial.exists() and not out.with_name(out.name + ".done").exists()
    # The output is a BEIR corpus: _id/title/text on every line, offsets included.
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"_id", "doc_id", "title", "text", "start", "end"}


def test_shards_partition_documents(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, 10)
    ids = [[d.id for d in read_documents(corpus, shard=Shard.parse(f"{k}/3"))] for k in (1, 2, 3)]
    assert sorted(sum(ids, [])) == sorted(f"doc{i}" for i in range(10))
    assert ids[0] == ["doc0", "doc3", "doc6", "doc9"]


def test_text_formats(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("First doc line one.\nline two.\n\n\nSecond doc.\n", encoding="utf-8")
    blocks = list(read_documents(path))
    assert [(d.id, d.text) for d in blocks] == [("0", "First doc line one.\nline two."), ("1", "Second doc.")]
    lines = list(read_documents(path, "text", text_unit="line"))
    assert [d.text for d in lines] == ["First doc line one.", "line two.", "Second doc."]


@pytest.mark.parametrize("content, line, field", [
    ('{"_id": "a", "text": "ok"}\n{"_id": "b", "text": 3}\n', 2, "text"),
    ('{"_id": "a", "text": "ok"}\n\n{"title": "x", "text": "y"}\n', 3, "_id"),
    ('{"_id": "a", "text": "ok"}\n{"_id": "a", "text": "again"}\n', 2, None),
    ('{"_id": "a", "text": "ok"}\nnot json\n', 2, None),
])
def test_malformed_input_names_file_and_line(tmp_path: Path, content: str, line: int, field: str | None) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        chunk_corpus(path, tmp_path / "out.jsonl")
    assert info.value.path == str(path) and info.value.line == line and info.value.field == field
    assert str(path) in str(info.value) and f"line {line}" in str(info.value)


def test_document_output_records_empty_documents(tmp_path: Path) -> None:
    out_path = tmp_path / "o.jsonl"
    out = DocumentOutput(out_path)
    out.write({"doc_id": "a", "v": 1})
    out.mark_done("a")
    out.mark_done("empty")
    out.write({"doc_id": "b", "v": 2})  # crash before b is marked done
    out.close()
    again = DocumentOutput(out_path)
    assert again.done == {"a", "empty"} and again.count == 1
    again.finish()
    assert [json.loads(x)["doc_id"] for x in out_path.read_text().splitlines()] == ["a"]


def test_cli_chunk(tmp_path: Path, capsys) -> None:
    from robustir.cli.main import main

    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, 4)
    out = tmp_path / "p.jsonl"
    assert main(["chunk", "--input", str(corpus), "--output", str(out), "--max-tokens", "10"]) == 0
    assert "passages" in capsys.readouterr().out
    assert out.exists()
    assert main(["chunk", "--input", str(corpus), "--output", str(out), "--max-tokens", "10"]) == 0  # complete: no-op
    assert "nothing to do" in capsys.readouterr().out
    assert main(["chunk", "--input", str(corpus), "--output", str(out)]) == 2  # other settings: not reused
    assert "max_tokens: 10 -> 256" in capsys.readouterr().err


def test_cli_output_cut_short_after_it_finished_is_made_again(tmp_path: Path, capsys, caplog) -> None:
    """A finished output that no longer matches its record (cut short, here) is made again with one warning, not
    reported complete. (On 5245875 the cut file was "complete; nothing to do" and later stages read it.)"""
    from robustir.cli.main import main

    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, 4)
    out = tmp_path / "p.jsonl"
    args = ["chunk", "--input", str(corpus), "--output", str(out), "--max-tokens", "10"]
    assert main(args) == 0
    whole = out.read_text()
    out.write_text("".join(whole.splitlines(keepends=True)[:2]))
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="robustir"):
        assert main(args) == 0
    assert "nothing to do" not in capsys.readouterr().out and out.read_text() == whole
    assert "is damaged (p.jsonl has 238 bytes, 718 were written): making it again" in caplog.text
