"""Texts cut before they are tokenized, so a long text costs the memory of what the model reads, not of its length.

A Hugging Face tokenizer called with ``truncation=True, max_length=n`` tokenizes the *whole* text before it cuts:
measured on the 2-core box (issue 35), ``robustir index`` and ``robustir audit`` took ~100-120 bytes of RAM per byte of
text (27 MB of documents -> 2.8 GB; one 24 MB positive -> 3.4 GB). :func:`head_texts` hands the tokenizer only a head
of each long text, and the token ids that come out are the same as from the whole text:

* a text of at most ``max_length * CHARS_PER_TOKEN`` characters is passed as it is (every text of the bundled data);
* a longer one is cut before the whitespace run nearest below that many characters. Every tokenizer robustir loads
  (WordPiece, SentencePiece / Metaspace, byte-level BPE) splits words at whitespace before it splits them into
  tokens, so the head's tokens are the whole text's first tokens; if the head makes at least ``max_length`` tokens
  (without special tokens) the truncated ids are identical. If it makes fewer (very long "words": base64, URLs), the
  head is made 4x longer and tried again, up to ``max_length * MAX_CHARS_PER_TOKEN`` characters -- past that the
  text is cut there (a bounded cost, and a model with that few tokens per character reads noise anyway).

``tests/test_encoder.py`` checks the ids against whole-text tokenization on long texts of every kind.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["head_texts", "CHARS_PER_TOKEN", "MAX_CHARS_PER_TOKEN"]

#: characters per token of the limit below which a text is not touched (English WordPiece averages ~4-5)
CHARS_PER_TOKEN = 16
#: the head never grows past this many characters per token of the limit
MAX_CHARS_PER_TOKEN = 1024


def head_texts(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[str]:
    """``texts`` with each long one cut to a head that tokenizes to the same first ``max_length`` ids (see the module
    docstring); short texts are returned as they are."""
    limit = max_length * CHARS_PER_TOKEN
    return [text if len(text) <= limit else _head(tokenizer, text, max_length) for text in texts]


def _head(tokenizer: Any, text: str, max_length: int) -> str:
    cut = max_length * CHARS_PER_TOKEN
    cap = max_length * MAX_CHARS_PER_TOKEN
    while True:
        if cut >= len(text):
            return text
        head, whole_words = _before_whitespace(text, cut)
        # counted up to what the test below needs (truncated: no "longer than the maximum" warning, no wasted ids)
        tokens = len(tokenizer(head, add_special_tokens=False, truncation=True, max_length=2 * max_length,
                               return_attention_mask=False, return_token_type_ids=False)["input_ids"])
        # a head cut inside a word (no whitespace in it: one giant word, or CJK without spaces) may tokenize its last
        # word differently: it is kept only with twice the tokens needed, so that word lies far past the limit
        if tokens >= (max_length if whole_words else 2 * max_length) or cut >= cap:
            return head
        cut *= 4


_SPACES = " \n\t\r\f\v"


def _before_whitespace(text: str, cut: int) -> tuple[str, bool]:
    """``(text[:i], True)`` for the start ``i`` of the last whitespace run that begins before ``cut`` (the head ends
    with a whole word); ``(text[:cut], False)`` if there is none."""
    end = max(text.rfind(space, 0, cut + 1) for space in _SPACES)
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return (text[:end], True) if end > 0 else (text[:cut], False)
