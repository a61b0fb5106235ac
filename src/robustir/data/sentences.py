"""Rule-based sentence splitting for English and Chinese (CJK) text, as exact character spans.

``split_sentences(text)`` returns ``[(start, end), ...]`` such that ``text[start:end]`` is a sentence with no
leading or trailing whitespace, spans are sorted and disjoint, and everything *between* spans (and before the
first / after the last) is whitespace. So the spans plus the whitespace between them reproduce ``text``.

Rules (cheap, pure Python, one regex pass per text):

* Newlines are hard boundaries: a sentence never spans a line break.
* Chinese / CJK: split after a run of ``。！？；﹒﹔﹖﹗．…`` plus up to two closing quotes ``”’」』"'``; after ``：``
  when an opening quote follows (the GUR authors' rule, docs/methods.md#gur-pair-mining-choices); and after ASCII
  ``!``/``?`` directly followed by a CJK character (mixed-width punctuation is common in web Chinese).
* English: split after a run of ``.!?…`` (plus closing quotes / brackets) that is followed by whitespace or the
  end of the line, unless the next word starts lower-case ("e.g. the"), or the word before the period is a
  known abbreviation ("et al.", "Fig.", "Dr."), a dotted acronym ("U.S.", "i.e."), or a single-letter initial
  ("J. K. Rowling"). Decimals ("3.5") never split because no whitespace follows the period.
"""

from __future__ import annotations

import re

from .cjk import CJK_CHAR_CLASS

__all__ = ["split_sentences"]

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
