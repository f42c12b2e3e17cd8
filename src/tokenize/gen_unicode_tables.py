#!/usr/bin/env python3
"""Generates src/tokenize/internal/unicode_tables.inc from Python's unicodedata.

The tables hold exactly the character properties that Hugging Face's
BertTokenizer consults (through Python's `unicodedata` and `str` methods), so
the C++ tokenizer and the Python reference agree code point for code point:

  * property ranges: drop (NUL, U+FFFD, category C* except \\t \\n \\r),
    space (BERT whitespace, or str.isspace()), CJK ideograph (BERT's
    `_is_chinese_char` ranges), punctuation (BERT's ASCII ranges + P*), Mn,
    "has lower mapping", "has canonical decomposition", "needs NFC work",
    plus the canonical combining class;
  * full lower-case mappings (str.lower() of one code point, as
    BertTokenizer lower-cases: one character at a time);
  * full canonical decompositions (NFD of one code point; Hangul excluded,
    it is algorithmic);
  * primary composites for NFC (pairs that recompose).

Usage: python3 src/tokenize/gen_unicode_tables.py [output.inc]
Re-run with the same Python whenever the Unicode version must change, and
regenerate tests/data/tokenizer/reference.json with that same Python.
"""

import os
import sys
import unicodedata

# Bit layout; must match CodePointFlag in internal/unicode_text.h.
DROP = 1 << 0
SPACE = 1 << 1
CJK = 1 << 2
PUNCT = 1 << 3
MN = 1 << 4
# Bits 5 and 6 are unused.
HAS_LOWER = 1 << 7
HAS_DECOMP = 1 << 8
NFC_CHECK = 1 << 9

HANGUL_S_BASE, HANGUL_S_COUNT = 0xAC00, 11172
HANGUL_V = range(0x1161, 0x1176)
HANGUL_T = range(0x11A8, 0x11C3)
MAX_CP = 0x110000


def is_hangul_syllable(cp):
    return HANGUL_S_BASE <= cp < HANGUL_S_BASE + HANGUL_S_COUNT


# The three predicates below are copied from transformers' tokenization_bert.py.
def bert_is_whitespace(ch):
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def bert_is_control(ch):
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch).startswith("C")


def bert_is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def bert_is_chinese_char(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF
            or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def compositions():
    """(first, second) -> composite for every primary composite."""
    pairs = {}
    for cp in range(MAX_CP):
        ch = chr(cp)
        d = unicodedata.decomposition(ch)
        if not d or d.startswith("<"):
            continue
        parts = [int(p, 16) for p in d.split()]
        if len(parts) == 2 and unicodedata.normalize("NFC", ch) == ch:
            pairs[(parts[0], parts[1])] = cp
    return pairs


def flags_of(cp, second_elements):
    ch = chr(cp)
    f = 0
    dropped = cp == 0 or cp == 0xFFFD or bert_is_control(ch)
    if dropped:
        f |= DROP
    if bert_is_whitespace(ch) or (ch.isspace() and not dropped):
        f |= SPACE
    if bert_is_chinese_char(cp):
        f |= CJK
    if bert_is_punctuation(ch):
        f |= PUNCT
    if unicodedata.category(ch) == "Mn":
        f |= MN
    if ch.lower() != ch:
        f |= HAS_LOWER
    if unicodedata.normalize("NFD", ch) != ch:
        f |= HAS_DECOMP
    if (unicodedata.combining(ch) != 0 or unicodedata.normalize("NFC", ch) != ch
            or cp in second_elements or cp in HANGUL_V or cp in HANGUL_T):
        f |= NFC_CHECK
    return f


def fmt_rows(items, per_line):
    lines = []
    for i in range(0, len(items), per_line):
        lines.append("    " + ", ".join(items[i:i + per_line]) + ",")
    return "\n".join(lines)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "internal", "unicode_tables.inc")

    pairs = compositions()
    second_elements = {b for (_, b) in pairs}

    ranges = []  # (first, flags, ccc)
    prev = None
    for cp in range(MAX_CP):
        key = (flags_of(cp, second_elements), unicodedata.combining(chr(cp)))
        if key != prev:
            ranges.append((cp,) + key)
            prev = key

    lower_entries, lower_pool = [], []
    for cp in range(MAX_CP):
        low = chr(cp).lower()
        if low != chr(cp):
            lower_entries.append((cp, len(lower_pool), len(low)))
            lower_pool.extend(ord(c) for c in low)

    decomp_entries, decomp_pool = [], []
    for cp in range(MAX_CP):
        if is_hangul_syllable(cp):
            continue
        nfd = unicodedata.normalize("NFD", chr(cp))
        if nfd != chr(cp):
            decomp_entries.append((cp, len(decomp_pool), len(nfd)))
            decomp_pool.extend(ord(c) for c in nfd)

    assert len(lower_pool) < 0xFFFF and len(decomp_pool) < 0xFFFF
    assert max(e[2] for e in lower_entries) <= 3
    assert max(e[2] for e in decomp_entries) <= 4

    parts = [
        "// Generated by src/tokenize/gen_unicode_tables.py from Python "
        f"{sys.version.split()[0]}'s unicodedata",
        f"// (Unicode {unicodedata.unidata_version}). Do not edit; re-run the generator.",
        "// Included once, by internal/unicode_text.cc, inside its namespace.",
        "",
        f'constexpr char kUnicodeVersion[] = "{unicodedata.unidata_version}";',
        "",
        "// Each range runs from `first` to the next entry's `first` - 1.",
        f"constexpr PropertyRange kPropertyRanges[{len(ranges)}] = {{",
        fmt_rows([f"{{0x{a:X}, 0x{f:X}, {c}}}" for a, f, c in ranges], 4),
        "};",
        "",
        "// str.lower() per code point.",
        f"constexpr CodePointMapping kLowerMappings[{len(lower_entries)}] = {{",
        fmt_rows([f"{{0x{a:X}, {o}, {n}}}" for a, o, n in lower_entries], 4),
        "};",
        f"constexpr char32_t kLowerPool[{len(lower_pool)}] = {{",
        fmt_rows([f"0x{c:X}" for c in lower_pool], 8),
        "};",
        "",
        "// Full canonical decomposition (NFD) of one code point, Hangul excluded.",
        f"constexpr CodePointMapping kDecompositions[{len(decomp_entries)}] = {{",
        fmt_rows([f"{{0x{a:X}, {o}, {n}}}" for a, o, n in decomp_entries], 4),
        "};",
        f"constexpr char32_t kDecompositionPool[{len(decomp_pool)}] = {{",
        fmt_rows([f"0x{c:X}" for c in decomp_pool], 8),
        "};",
        "",
        "// Primary composites, sorted by (first, second), Hangul excluded.",
        f"constexpr Composition kCompositions[{len(pairs)}] = {{",
        fmt_rows([f"{{0x{a:X}, 0x{b:X}, 0x{c:X}}}" for (a, b), c in sorted(pairs.items())], 3),
        "};",
        "",
    ]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    print(f"wrote {out_path}: {len(ranges)} ranges, {len(lower_entries)} lower, "
          f"{len(decomp_entries)} decompositions, {len(pairs)} compositions")


if __name__ == "__main__":
    main()
