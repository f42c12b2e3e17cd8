#!/usr/bin/env python3
"""Reference BERT WordPiece tokenizer: a standalone port of Hugging Face
transformers' BertTokenizer (BasicTokenizer + WordpieceTokenizer, with
never_split empty), needing only the Python standard library. Like
BertTokenizer.tokenize (PreTrainedTokenizer.tokenize), an uncased tokenizer
first lower-cases the text one character at a time, before BasicTokenizer:
so an upper-case sigma always becomes σ, never the final ς that str.lower()
gives a whole word, and NFC sees lower-case letters.

Shoal's C++ tokenizer (src/tokenize/) must give the same tokens and ids. The
results depend on the Unicode version of Python's unicodedata; the C++ tables
(src/tokenize/gen_unicode_tables.py) must come from the same version.

Usage:
  reference_wordpiece.py --vocab VOCAB --text "Some text"   # print tokens, ids
  reference_wordpiece.py --vocab VOCAB --write-reference OUT.json
      (re)writes the reference cases used by src/tokenize's tests, e.g.
      --vocab tests/data/tokenizer/vocab.txt
      --write-reference tests/data/tokenizer/reference.json
"""

import argparse
import collections
import json
import random
import sys
import unicodedata


def load_vocab(path):
    vocab = collections.OrderedDict()
    with open(path, "r", encoding="utf-8") as reader:
        tokens = reader.readlines()
    for index, token in enumerate(tokens):
        vocab[token.rstrip("\n")] = index
    return vocab


def whitespace_tokenize(text):
    text = text.strip()
    if not text:
        return []
    return text.split()


def _is_whitespace(char):
    if char == " " or char == "\t" or char == "\n" or char == "\r":
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char):
    if char == "\t" or char == "\n" or char == "\r":
        return False
    return unicodedata.category(char).startswith("C")


def _is_punctuation(char):
    cp = ord(char)
    if (33 <= cp <= 47) or (58 <= cp <= 64) or (91 <= cp <= 96) or (123 <= cp <= 126):
        return True
    return unicodedata.category(char).startswith("P")


class BasicTokenizer:
    def __init__(self, do_lower_case=True, tokenize_chinese_chars=True, strip_accents=None):
        self.do_lower_case = do_lower_case
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.strip_accents = strip_accents

    def tokenize(self, text):
        text = self._clean_text(text)
        if self.tokenize_chinese_chars:
            text = self._tokenize_chinese_chars(text)
        # Prevents treating the same character with different unicode
        # codepoints as different characters.
        unicode_normalized_text = unicodedata.normalize("NFC", text)
        orig_tokens = whitespace_tokenize(unicode_normalized_text)
        split_tokens = []
        for token in orig_tokens:
            if self.do_lower_case:
                token = token.lower()
                if self.strip_accents is not False:
                    token = self._run_strip_accents(token)
            elif self.strip_accents:
                token = self._run_strip_accents(token)
            split_tokens.extend(self._run_split_on_punc(token))
        return whitespace_tokenize(" ".join(split_tokens))

    def _run_strip_accents(self, text):
        text = unicodedata.normalize("NFD", text)
        return "".join(c for c in text if unicodedata.category(c) != "Mn")

    def _run_split_on_punc(self, text):
        chars = list(text)
        i = 0
        start_new_word = True
        output = []
        while i < len(chars):
            char = chars[i]
            if _is_punctuation(char):
                output.append([char])
                start_new_word = True
            else:
                if start_new_word:
                    output.append([])
                start_new_word = False
                output[-1].append(char)
            i += 1
        return ["".join(x) for x in output]

    def _tokenize_chinese_chars(self, text):
        output = []
        for char in text:
            if self._is_chinese_char(ord(char)):
                output.extend((" ", char, " "))
            else:
                output.append(char)
        return "".join(output)

    @staticmethod
    def _is_chinese_char(cp):
        return ((0x4E00 <= cp <= 0x9FFF) or (0x3400 <= cp <= 0x4DBF)
                or (0x20000 <= cp <= 0x2A6DF) or (0x2A700 <= cp <= 0x2B73F)
                or (0x2B740 <= cp <= 0x2B81F) or (0x2B820 <= cp <= 0x2CEAF)
                or (0xF900 <= cp <= 0xFAFF) or (0x2F800 <= cp <= 0x2FA1F))

    def _clean_text(self, text):
        output = []
        for char in text:
            cp = ord(char)
            if cp == 0 or cp == 0xFFFD or _is_control(char):
                continue
            output.append(" " if _is_whitespace(char) else char)
        return "".join(output)


class WordpieceTokenizer:
    def __init__(self, vocab, unk_token, max_input_chars_per_word=100):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word

    def tokenize(self, text):
        output_tokens = []
        for token in whitespace_tokenize(text):
            chars = list(token)
            if len(chars) > self.max_input_chars_per_word:
                output_tokens.append(self.unk_token)
                continue
            is_bad = False
            start = 0
            sub_tokens = []
            while start < len(chars):
                end = len(chars)
                cur_substr = None
                while start < end:
                    substr = "".join(chars[start:end])
                    if start > 0:
                        substr = "##" + substr
                    if substr in self.vocab:
                        cur_substr = substr
                        break
                    end -= 1
                if cur_substr is None:
                    is_bad = True
                    break
                sub_tokens.append(cur_substr)
                start = end
            if is_bad:
                output_tokens.append(self.unk_token)
            else:
                output_tokens.extend(sub_tokens)
        return output_tokens


class BertTokenizer:
    def __init__(self, vocab, lowercase=True, strip_accents=True,
                 tokenize_chinese_chars=True, max_input_chars_per_word=100,
                 unk_token="[UNK]"):
        self.vocab = vocab
        self.basic = BasicTokenizer(lowercase, tokenize_chinese_chars, strip_accents)
        self.wordpiece = WordpieceTokenizer(vocab, unk_token, max_input_chars_per_word)

    def basic_tokenize(self, text):
        if self.basic.do_lower_case:
            # PreTrainedTokenizer.tokenize: re.sub(r"(.+?)", lower) over the
            # text (no special tokens are matched here: never_split is empty).
            text = "".join(c.lower() for c in text)
        return self.basic.tokenize(text)

    def tokenize(self, text):
        tokens = []
        for token in self.basic_tokenize(text):
            tokens.extend(self.wordpiece.tokenize(token))
        return tokens

    def convert_tokens_to_ids(self, tokens):
        return [self.vocab[t] for t in tokens]


def _decode_input(case):
    if "text_hex" in case:
        # Invalid UTF-8 reaches Python's tokenizer as U+FFFD replacements.
        return bytes.fromhex(case["text_hex"]).decode("utf-8", errors="replace")
    return case["text"]


CASED = {"lowercase": False, "strip_accents": False}
KEEP_ACCENTS = {"lowercase": True, "strip_accents": False}

CASES = [
    ("punctuation", "Hello, World! (tokens) [x] {y} <z> a.b-c_d/e", None),
    ("sentence", "The quick brown fox jumps over the lazy dog.", None),
    ("subwords", "unaffable running jumped", None),
    ("apostrophes", "Don't stop! It\u2019s y'all's, isn't it?", None),
    ("accents", "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \u00c9COLE", None),
    ("vietnamese", "Ti\u1ebfng Vi\u1ec7t", None),
    ("cjk", "\u4e2d\u6587\u5b57", None),
    ("cjk_mixed", "na\u00efve\u4e2d\u6587caf\u00e9 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", None),
    ("emoji", "I \u2764\ufe0f \U0001f980 tokens \U0001f468\u200d\U0001f469\u200d\U0001f467!", None),
    ("long_word_unk", "a" * 101, None),
    ("word_at_limit", "b" * 100, None),
    ("long_word_split_by_punct", "-".join(["abc"] * 40), None),
    ("whitespace", "  hello\tworld\nfoo\r\nbar\u00a0baz\u3000qux\u2003end  ", None),
    ("line_separators", "a\u2028b\u2029c\x0bd\x0ce\x85f", None),
    ("control_chars", "hel\x00lo\x01 wor\u200bld\ufeff \x7fdog\u00ad", None),
    ("upper_case", "HELLO WORLD ThE QuIcK", None),
    ("greek_final_sigma", "\u039f\u0394\u039f\u03a3 \u03a3\u0391\u03a3. \u0391\u03a3'\u0391 \u03a3", None),
    ("cyrillic", "\u041f\u0420\u0418\u0412\u0415\u0422, \u041c\u0418\u0420!", None),
    ("numbers", "In 2024, 3.14159 people paid $1,000.50 (20%)", None),
    ("empty", "", None),
    ("only_whitespace", " \t\n\r\u00a0 ", None),
    ("dotted_capital_i", "\u0130stanbul \u0131", None),
    ("german", "Stra\u00dfe STRASSE \u1e9e", None),
    ("fullwidth", "\uff28\uff25\uff2c\uff2c\uff2f\uff01", None),
    ("decomposed_input", "cafe\u0301 nai\u0308ve", None),
    ("decomposed_input_cased", "cafe\u0301 Cafe\u0301 caf\u00e9", CASED),
    ("accents_cased", "Caf\u00e9 Ti\u1ebfng \u00c5ngstr\u00f6m", CASED),
    ("mark_order", "a\u0323\u0302 a\u0302\u0323 \u1ead", None),
    ("mark_order_cased", "a\u0323\u0302 a\u0302\u0323 \u1ead", CASED),
    ("hangul", "\ud55c\uad6d\uc5b4", None),
    ("hangul_cased", "\ud55c\uad6d\uc5b4 \u1112\u1161\u11ab", CASED),
    ("compat_ideograph", "\uf900\u8c48", None),
    ("private_and_unassigned", "x\ue000y\u0378z", None),
    ("musical_reorder", "\U0001d16d\U0001d165 \U0001d15e", None),
    ("ligature_and_titlecase", "\ufb01ne \u01c5 \u01c4", None),
    ("punctuation_storm",
     "\u00bfQu\u00e9? \u00abBonjour\u00bb \u2014 \u201cquoted\u201d \u2026 @user #hash "
     "$5 ^_^ ~tilde~ `tick` |pipe| back\\slash", None),
    ("url_email", "user@example.com https://www.example.com/path?q=1&r=2", None),
    ("no_chinese_split", "\u4e2d\u6587\u5b57 ab\u4e2dcd",
     {"tokenize_chinese_chars": False}),
    ("max_chars_cased_bytes", " ".join(["\u00e9" * 100, "\u00e9" * 101]), CASED),
    ("max_chars_option", "abcdef abcdefg", {"max_input_chars_per_word": 6}),
    ("unknown_piece", "xyz\u00fe qq\u0416", None),
    ("invalid_utf8_hex", None, None),
    # Lower-cased before NFC: h + U+0331 composes to U+1E96, H + U+0331 has no
    # composite (likewise J/T/W with their marks).
    ("lower_then_nfc", "H\u0331 J\u030c T\u0308 W\u030a \u00c5", KEEP_ACCENTS),
    ("greek_keep_accents", "\u038c\u0394\u039f\u03a3 \u0391\u03a3\u0301", KEEP_ACCENTS),
]

INVALID_UTF8_HEX = (
    b"hel\xfflo \xc3\x28 w\xe2\x82orld \xed\xa0\x80x \xc0\xafy \xf4\x90\x80\x80z "
    b"\xf0\x9f\x98 end \x80\xbf caf\xc3\xa9"
).hex()

# Code points a random string is drawn from: every feature the tokenizer has.
FUZZ_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + [" "] * 8 + ["\t", "\n", "\r"]
    + [chr(c) for c in range(0x00A0, 0x0250)]                 # Latin-1, Ext-A/B
    + [chr(c) for c in range(0x0300, 0x0370)]                 # combining marks
    + [chr(c) for c in range(0x0370, 0x0400)] + ["\u03a3"] * 6  # Greek
    + [chr(c) for c in range(0x0400, 0x0530)]                 # Cyrillic
    + [chr(c) for c in range(0x0590, 0x0600)]                 # Hebrew marks
    + [chr(c) for c in range(0x0900, 0x0980)]                 # Devanagari
    + ["\u09c7", "\u09be", "\u09d7", "\u0b47", "\u0b3e", "\u0b56"]
    + [chr(c) for c in range(0x1100, 0x1200)]                 # Hangul jamo
    + [chr(c) for c in range(0x1E00, 0x1F00)]                 # Latin Ext Additional
    + [chr(c) for c in range(0x1F00, 0x2000)]                 # Greek Extended
    + [chr(c) for c in range(0x2000, 0x2070)]                 # spaces, Cf, punct
    + ["\u2126", "\u212a", "\u212b", "\u2160", "\u24b6", "\u2c00", "\u2c30"]
    + [chr(c) for c in range(0x3000, 0x3040)] + ["\u3042", "\u30a2", "\u30fc"]
    + ["\u4e00", "\u4e2d", "\u6587", "\u5b57", "\u3400", "\uf900", "\ufa0e", "\ufa6d"]
    + ["\uac00", "\ud55c", "\uad6d", "\uc5b4", "\ud7a3"]
    + ["\ue000", "\ufeff", "\ufffd", "\ufe0f", "\uff21", "\uff41", "\uff01"]
    + ["\x00", "\x01", "\x0b", "\x0c", "\x1f", "\x7f", "\x85", "\u0378", "\u0530"]
    + ["\U0001d15e", "\U0001d165", "\U0001d16d", "\U0001f600", "\U0001f980",
       "\U00010400", "\U00010428", "\U0001e900", "\U00020000", "\U0002f800",
       "\U0002a700", "\U000e0001", "\U000f0000"]
)


def make_cases():
    cases = []
    for name, text, options in CASES:
        case = {"name": name}
        if name == "invalid_utf8_hex":
            case["text_hex"] = INVALID_UTF8_HEX
        else:
            case["text"] = text
        if options:
            case["options"] = options
        cases.append(case)
    rng = random.Random(20240521)
    for i in range(120):
        length = rng.randint(1, 24)
        text = "".join(rng.choice(FUZZ_POOL) for _ in range(length))
        case = {"name": f"fuzz_{i:03d}", "text": text}
        if i % 2 == 1:
            case["options"] = CASED
        cases.append(case)
    # Lower-cased with accents kept: lowering before NFC matters only here.
    rng = random.Random(20261203)
    for i in range(40):
        length = rng.randint(1, 24)
        text = "".join(rng.choice(FUZZ_POOL) for _ in range(length))
        cases.append({"name": f"fuzz_keep_accents_{i:03d}", "text": text, "options": KEEP_ACCENTS})
    return cases


def tokenizer_for(vocab, options):
    options = options or {}
    return BertTokenizer(
        vocab,
        lowercase=options.get("lowercase", True),
        strip_accents=options.get("strip_accents", True),
        tokenize_chinese_chars=options.get("tokenize_chinese_chars", True),
        max_input_chars_per_word=options.get("max_input_chars_per_word", 100))


def write_reference(vocab, out_path):
    results = []
    for case in make_cases():
        tok = tokenizer_for(vocab, case.get("options"))
        text = _decode_input(case)
        tokens = tok.tokenize(text)
        case["basic"] = tok.basic_tokenize(text)
        case["tokens"] = tokens
        case["ids"] = tok.convert_tokens_to_ids(tokens)
        results.append(case)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"wrote {len(results)} cases to {out_path} "
          f"(Unicode {unicodedata.unidata_version})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--text")
    parser.add_argument("--cased", action="store_true",
                        help="lowercase=False, strip_accents=False")
    parser.add_argument("--write-reference", metavar="OUT")
    args = parser.parse_args()
    vocab = load_vocab(args.vocab)
    if args.write_reference:
        write_reference(vocab, args.write_reference)
    if args.text is not None:
        tok = tokenizer_for(vocab, CASED if args.cased else None)
        tokens = tok.tokenize(args.text)
        print(json.dumps({"tokens": tokens, "ids": tok.convert_tokens_to_ids(tokens)},
                         ensure_ascii=False))
    if not args.write_reference and args.text is None:
        parser.error("give --text or --write-reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
