"""Rule-based sentence splitting for English and Chinese (CJK) text, as exact character spans.

``split_sentences(text)`` returns ``[(start, end), ...]`` such that ``text[start:end]`` is a sentence with no
leading or trailing whitespace, spans are sorted and disjoint, and everything *between* spans (and before the
first / after the last) is whitespace. So the spans plus the whitespace between them reproduce ``text``.

Rules (cheap, pure Python, one regex pass per text):

* Newlines are hard boundaries: a sentence never spans a line break.
* Chinese / CJK: split after a run of ``。！？；﹒﹔﹖﹗．…`` plus up to two closing quotes ``”’」』"'``; after ``：``
  when an opening quote follows (the GUR authors' rule, methods-notes §3.1); and after ASCII ``!``/``?``
  directly followed by a CJK character (mixed-width punctuation is common in web Chinese).
* English: split after a run of ``.!?…`` (plus closing quotes / brackets) that is followed by whitespace or the
  end of the line, unless the next word starts lower-case ("e.g. the"), or the word before the period is a
  known abbreviation ("et al.", "Fig.", "Dr."), a dotted acronym ("U.S.", "i.e."), or a single-letter initial
  ("J. K. Rowling"). Decimals ("3.5") never split because no whitespace follows the period.
"""

from __future__ import annotations

import re
from bisect import bisect_right

__all__ = ["split_sentences", "is_cjk", "cjk_ratio", "CJK_CHAR_CLASS"]

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

# The same ranges as a regex character class (used by token counters and the splitter).
CJK_CHAR_CLASS = "".join(
    f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in _CJK_RANGES
)


def is_cjk(ch: str) -> bool:
    """True when the single character ``ch`` is a CJK ideograph, kana, Hangul, or CJK/fullwidth punctuation."""
    code = ord(ch)
    i = bisect_right(_RANGE_STARTS, code) - 1
    return i >= 0 and code <= _CJK_RANGES[i][1]


_CJK_RE = re.compile(f"[{CJK_CHAR_CLASS}]")
_NON_SPACE_RE = re.compile(r"\S")


def cjk_ratio(text: str) -> float:
    """Share of the non-whitespace characters of ``text`` that are CJK (0.0 for empty text)."""
    total = len(_NON_SPACE_RE.findall(text))
    return len(_CJK_RE.findall(text)) / total if total else 0.0


# Lower-cased words that end with a period but (almost) never end a sentence.
ABBREVIATIONS: frozenset[str] = frozenset({
    "al", "e.g", "i.e", "cf", "vs", "viz", "approx", "ca", "fig", "figs", "eq", "eqs", "ref", "refs", "tab",
    "sect", "sec", "ch", "vol", "vols", "pp", "no", "nos", "dr", "mr", "mrs", "ms", "prof", "st", "jr", "sr",
    "inc", "ltd", "co", "corp", "dept", "univ", "est", "resp", "jan", "feb", "mar", "apr", "jun", "jul", "aug",
    "sep", "sept", "oct", "nov", "dec", "mt", "gen", "gov", "rev", "hon", "lt", "col", "sgt", "capt",
})

_CLOSERS_EN = "\"'”’)\\]"
_CLOSERS_CJK = "”’」』\"'"
# One alternation, scanned left to right; each alternative ends exactly at the end of a sentence.
_BOUNDARY_RE = re.compile(
    "|".join([
        # CJK terminators, no space needed after them.
        f"(?P<cjk>[。！？；﹒﹔﹖﹗．…]+[{_CLOSERS_CJK}]{{0,2}})",
        # Full-width colon that opens a quotation (authors' rule).
        "(?P<colon>：)(?=[“‘「『])",
        # ASCII !/? glued to a following CJK character.
        f"(?P<mixed>[!?]+[{_CLOSERS_CJK}]{{0,2}})(?=[{CJK_CHAR_CLASS}])",
        # English terminators followed by whitespace or end of string.
        f"(?P<en>[.!?]+[{_CLOSERS_EN}]{{0,3}})(?=\\s|$)",
    ])
)
_WORD_BEFORE_RE = re.compile(r"(\S+)$")
_INITIAL_RE = re.compile(r"^[A-Z]$")
_DOTTED_RE = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]$")  # "e.g", "U.S", "i.e" (final period stripped)


def _next_is_lower(text: str, after: int) -> bool:
    """Is the next non-blank character after ``after`` (same line) an ASCII lower-case letter?"""
    n = len(text)
    k = after
    while k < n and text[k] in " \t\u00a0\u3000":
        k += 1
    return k < n and text[k].isascii() and text[k].islower()


def _english_break_ok(text: str, term_start: int, term: str, after: int) -> bool:
    """Decide whether an English terminator at ``text[term_start:after]`` really ends the sentence."""
    if _next_is_lower(text, after):
        return False  # "e.g. the", "etc. and": a sentence rarely starts lower-case
    if term[0] != "." or term.startswith(".."):
        return True  # "!", "?", and "..." followed by upper-case do end sentences
    match = _WORD_BEFORE_RE.search(text, max(0, term_start - 40), term_start)
    if match is None:
        return True
    word = match.group(1).lstrip("([\"'“‘")
    if not word:
        return True
    lowered = word.lower()
    if lowered in ABBREVIATIONS or _INITIAL_RE.match(word) or _DOTTED_RE.match(word):
        return False
    return True


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Split ``text`` into sentences; return ``(start, end)`` character spans (see the module docstring)."""
    spans: list[tuple[int, int]] = []
    n = len(text)
    line_start = 0
    while line_start <= n:
        nl = text.find("\n", line_start)
        line_end = n if nl < 0 else nl
        _split_line(text, line_start, line_end, spans)
        if nl < 0:
            break
        line_start = nl + 1
    return spans


def _split_line(text: str, lo: int, hi: int, out: list[tuple[int, int]]) -> None:
    """Append the sentence spans of ``text[lo:hi]`` (one line, no newline inside) to ``out``."""
    line = text[lo:hi]
    piece_start = 0
    for match in _BOUNDARY_RE.finditer(line):
        end = match.end()
        if match.lastgroup == "en":
            if not _english_break_ok(line, match.start(), match.group("en"), end):
                continue
        elif match.lastgroup == "cjk" and end < len(line) and line[end].isspace() \
                and match.group("cjk").strip("…") == "" and _next_is_lower(line, end):
            continue  # "so on… and then": an English ellipsis inside a sentence
        _emit(text, lo + piece_start, lo + end, out)
        piece_start = end
    _emit(text, lo + piece_start, hi, out)


def _emit(text: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    """Append ``[start, end)`` trimmed of surrounding whitespace, if anything is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if end > start:
        out.append((start, end))
