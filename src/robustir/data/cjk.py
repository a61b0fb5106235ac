"""The one definition of "CJK" in robustir: which characters count, and how CJK a text is.

Every stage that treats Chinese, Japanese or Korean text differently asks here: sentence splitting and token
counting (``data/sentences.py``, ``data/chunking.py``), BM25 analysis (``index/bm25.py``: CJK runs become
character n-grams), the prompt language of LLM steps (``cjk_share`` against ``cjk_threshold``) and GUR's
character weights (``queries/pairs.py``).
"""

from __future__ import annotations

import re
from bisect import bisect_right

__all__ = ["is_cjk", "cjk_share", "CJK_CHAR_CLASS", "CJK_RUN"]

# Inclusive code-point ranges counted as CJK: CJK punctuation, kana, Hangul, ideographs, fullwidth forms.
_CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x1100, 0x11FF),    # Hangul Jamo
    (0x2E80, 0x2FDF),    # CJK radicals, Kangxi radicals
    (0x3000, 0x303F),    # CJK symbols and punctuation (。「」 …)
    (0x3040, 0x30FF),    # Hiragana, Katakana
    (0x3100, 0x31BF),    # Bopomofo, Hangul compatibility Jamo, Kanbun
    (0x31C0, 0x31FF),    # CJK strokes, Katakana extensions
    (0x3200, 0x33FF),    # enclosed CJK, CJK compatibility
    (0x3400, 0x4DBF),    # CJK Unified Ideographs Extension A
    (0x4E00, 0x9FFF),    # CJK Unified Ideographs
    (0xA960, 0xA97F),    # Hangul Jamo Extended-A
    (0xAC00, 0xD7FF),    # Hangul syllables, Jamo Extended-B
    (0xF900, 0xFAFF),    # CJK compatibility ideographs
    (0xFE30, 0xFE4F),    # CJK compatibility forms
    (0xFE50, 0xFE6F),    # small form variants (﹒﹔﹖﹗)
    (0xFF00, 0xFFEF),    # halfwidth and fullwidth forms (！？；：．)
    (0x20000, 0x3134F),  # Extensions B-G and compatibility supplement
)
_RANGE_STARTS = [lo for lo, _ in _CJK_RANGES]

CJK_CHAR_CLASS = "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in _CJK_RANGES)
"""The ranges as the inside of a regex character class: ``re.compile(f"[{CJK_CHAR_CLASS}]")``."""

CJK_RUN = re.compile(f"[{CJK_CHAR_CLASS}]+")
"""A maximal run of CJK characters."""


def is_cjk(ch: str) -> bool:
    """True when the single character ``ch`` is a CJK ideograph, kana, Hangul, or CJK/fullwidth punctuation."""
    code = ord(ch)
    i = bisect_right(_RANGE_STARTS, code) - 1
    return i >= 0 and code <= _CJK_RANGES[i][1]


def cjk_share(text: str) -> float:
    """Share of the letters and digits of ``text`` that are CJK (0.0 for text without any).

    Punctuation and spaces do not count either way, so "北京 is big" is 2/7 and a Chinese sentence with
    Latin punctuation is still 1.0.
    """
    alnum = [ch for ch in text if ch.isalnum()]
    return sum(map(is_cjk, alnum)) / len(alnum) if alnum else 0.0
