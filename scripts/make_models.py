#!/usr/bin/python3
"""Builds Shoal's demo model repository: seeded BERT encoders in TorchScript.

Usage: /usr/bin/python3 scripts/make_models.py --out models [--only tiny]

For each model it writes into DIR/<name>/:
  model.pt        TorchScript, (input_ids i64 [B,T], attention_mask i64 [B,T])
                  -> last_hidden_state f32 [B,T,H]
  vocab.txt       BERT-layout WordPiece vocabulary (30522 lines)
  reference.json  pooled + normalised embeddings for fixed token ids, used by
                  the C++ tests to check numeric agreement
  shoal.json      copied from the repository's models/<name>/shoal.json when
                  missing (never overwritten)
  .stamp          generator version and model spec; a model whose stamp
                  matches is skipped, so running the script twice is cheap

Weights are random (torch.manual_seed), so embeddings carry no meaning; the
shapes, runtime cost and I/O contract are those of the real models. The
module names follow Hugging Face's BertModel, so a real checkpoint traced the
same way (see docs/models.md) is a drop-in replacement.

Needs only torch (Debian's python3-torch); no network access.
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import unicodedata

try:
    import torch
    from torch import nn
except ImportError:
    sys.exit(f"make_models.py: {sys.executable} has no torch; run it with /usr/bin/python3 "
             "(Debian's python3-torch, installed by scripts/install-deps.sh)")

GENERATOR_VERSION = 1
VOCAB_SIZE = 30522
NUM_UNUSED = 994  # [unused0] .. [unused993], as in bert-base-uncased
WORDS_FILE = "/usr/share/dict/words"

REPO_MODELS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")

MODELS = {
    "minilm-l6": dict(layers=6, hidden=384, heads=12, intermediate=1536,
                      seed=20240601, dim=384),
    "tiny-bert": dict(layers=2, hidden=64, heads=4, intermediate=256,
                      seed=20240602, dim=64),
}
# Sequence classification heads on a BERT body (three inputs, logits out):
# a cross-encoder for rerank / score (one label) and a text classifier.
HEAD_MODELS = {
    "tiny-reranker": dict(layers=2, hidden=64, heads=4, intermediate=256,
                          seed=20240611, num_labels=1, task="score"),
    "tiny-classifier": dict(layers=2, hidden=64, heads=4, intermediate=256,
                            seed=20240612, num_labels=3, task="classify",
                            labels=["negative", "neutral", "positive"]),
}
ALIASES = {"tiny": "tiny-bert", "minilm": "minilm-l6", "tiny-py": "tiny-bert-py",
           "reranker": "tiny-reranker", "classifier": "tiny-classifier"}
# Eager-mode copies served by Shoal's Python runtime (runtimes/python): same
# architecture and seed as the TorchScript model they shadow, so both must
# give the same embeddings.
PYTHON_MODELS = {"tiny-bert-py": "tiny-bert"}
PYTHON_RUNTIME = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "runtimes", "python", "shoal_runtime.py")
COMMON = dict(vocab=VOCAB_SIZE, max_positions=512, type_vocab=2,
              layer_norm_eps=1e-12)

# Fixed inputs for reference.json: [CLS] ... [SEP], different lengths.
REFERENCE_INPUTS = [
    [101, 7592, 1010, 2088, 999, 102],
    [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 1012, 102],
    [101] + [1000 + (i * 7919) % 29000 for i in range(46)] + [102],
]


# --------------------------------------------------------------------------
# Model: BERT encoder, parameter names as in transformers' BertModel.


class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab"], c["hidden"], padding_idx=0)
        self.position_embeddings = nn.Embedding(c["max_positions"], c["hidden"])
        self.token_type_embeddings = nn.Embedding(c["type_vocab"], c["hidden"])
        self.LayerNorm = nn.LayerNorm(c["hidden"], eps=c["layer_norm_eps"])
        self.register_buffer(
            "position_ids", torch.arange(c["max_positions"]).unsqueeze(0),
            persistent=False)

    def forward(self, input_ids, token_type_ids=None):
        seq_len = input_ids.size(1)
        # Slicing a buffer by a traced size keeps the sequence length dynamic.
        position_ids = self.position_ids[:, :seq_len]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids)
             + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c["heads"]
        self.head_dim = c["hidden"] // c["heads"]
        self.query = nn.Linear(c["hidden"], c["hidden"])
        self.key = nn.Linear(c["hidden"], c["hidden"])
        self.value = nn.Linear(c["hidden"], c["hidden"])

    def split(self, x):
        b, t = x.size(0), x.size(1)
        return x.view(b, t, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, mask_bias):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + mask_bias, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size(0), ctx.size(1), -1)


class SelfOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden"], c["hidden"])
        self.LayerNorm = nn.LayerNorm(c["hidden"], eps=c["layer_norm_eps"])

    def forward(self, h, x):
        return self.LayerNorm(self.dense(h) + x)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = SelfOutput(c)

    def forward(self, x, mask_bias):
        return self.output(self.self(x, mask_bias), x)


class Intermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden"], c["intermediate"])

    def forward(self, x):
        return nn.functional.gelu(self.dense(x))  # exact (erf) GELU, as BERT


class Output(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["intermediate"], c["hidden"])
        self.LayerNorm = nn.LayerNorm(c["hidden"], eps=c["layer_norm_eps"])

    def forward(self, h, x):
        return self.LayerNorm(self.dense(h) + x)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = Output(c)

    def forward(self, x, mask_bias):
        a = self.attention(x, mask_bias)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([Layer(c) for _ in range(c["layers"])])

    def forward(self, x, mask_bias):
        for layer in self.layer:
            x = layer(x, mask_bias)
        return x


class BertEncoder(nn.Module):
    """(input_ids, attention_mask) -> last_hidden_state; no pooler."""

    def __init__(self, c):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)

    def forward(self, input_ids, attention_mask):
        x = self.embeddings(input_ids)
        # [B,1,1,T]: 0 for real tokens, a large negative for padding.
        mask = attention_mask[:, None, None, :].to(x.dtype)
        mask_bias = (1.0 - mask) * torch.finfo(x.dtype).min
        return self.encoder(x, mask_bias)


class Pooler(nn.Module):
    """BERT's pooler: dense + tanh on the [CLS] position."""

    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden"], c["hidden"])

    def forward(self, x):
        return torch.tanh(self.dense(x[:, 0]))


class BertModel(nn.Module):
    """Encoder with segment ids and the pooler, as transformers' BertModel."""

    def __init__(self, c):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)
        self.pooler = Pooler(c)

    def forward(self, input_ids, attention_mask, token_type_ids):
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask[:, None, None, :].to(x.dtype)
        mask_bias = (1.0 - mask) * torch.finfo(x.dtype).min
        return self.pooler(self.encoder(x, mask_bias))


class BertForSequenceClassification(nn.Module):
    """(input_ids, attention_mask, token_type_ids) -> logits [B, labels]:
    a cross-encoder (one label) or a text classifier. Parameter names as in
    transformers' BertForSequenceClassification."""

    def __init__(self, c):
        super().__init__()
        self.bert = BertModel(c)
        self.classifier = nn.Linear(c["hidden"], c["num_labels"])

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.classifier(self.bert(input_ids, attention_mask, token_type_ids))


def init_weights(model, seed):
    """BERT's initialisation (normal 0.02, LayerNorm 1/0), seeded."""
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------
# Vocabulary in bert-base-uncased layout.


def _normalise_word(w):
    """Lowercase and strip accents like BERT's basic tokenizer."""
    w = unicodedata.normalize("NFD", w.strip().lower())
    return "".join(ch for ch in w if unicodedata.category(ch) != "Mn")


def _single_chars():
    chars = [chr(c) for c in range(33, 127)]                     # ASCII printable
    chars += [chr(c) for c in range(0xA1, 0x100) if chr(c).isprintable()
              and not chr(c).isspace()]                          # Latin-1
    chars += [chr(c) for c in range(0x3B1, 0x3CA)]               # Greek lowercase
    chars += [chr(c) for c in range(0x430, 0x450)]               # Cyrillic lowercase
    chars += list("–—‘’“”•…€™")                                   # typography
    chars += [chr(c) for c in range(0x3041, 0x3097)]             # Hiragana
    chars += [chr(c) for c in range(0x4E00, 0x4E00 + 300)]       # CJK (first block)
    return chars


COMMON_SUFFIXES = [
    "s", "es", "ed", "d", "ing", "ly", "er", "ers", "est", "ion", "ions",
    "tion", "tions", "ation", "ations", "ness", "ment", "ments", "able",
    "ible", "al", "ally", "ful", "less", "ity", "ities", "ive", "ize", "ized",
    "izes", "izing", "ise", "ised", "ism", "ist", "ists", "ian", "ians", "ic",
    "ical", "ous", "y", "ies", "ied", "en", "or", "ors", "ship", "hood",
    "ward", "wards", "like", "ling", "let", "ette", "ee", "ees", "ance",
    "ence", "ant", "ent", "ary", "ery", "ory", "ure", "age", "dom",
]


def build_vocab(words_file=WORDS_FILE):
    """Returns exactly VOCAB_SIZE distinct tokens in bert-base-uncased order."""
    vocab, seen = [], set()

    def add(tok):
        if tok and tok not in seen and not any(ch.isspace() for ch in tok):
            seen.add(tok)
            vocab.append(tok)

    add("[PAD]")
    for i in range(99):
        add(f"[unused{i}]")
    for tok in ("[UNK]", "[CLS]", "[SEP]", "[MASK]"):
        add(tok)
    for i in range(99, NUM_UNUSED):
        add(f"[unused{i}]")
    assert vocab.index("[UNK]") == 100 and vocab.index("[MASK]") == 103

    chars = _single_chars()
    for ch in chars:
        add(ch)
    for ch in chars:
        add("##" + ch)
    for s in COMMON_SUFFIXES:
        add("##" + s)
    for n in list(range(0, 101)) + list(range(1900, 2031)):
        add(str(n))

    words = []
    raw = []
    if os.path.exists(words_file):
        with open(words_file, encoding="utf-8", errors="ignore") as f:
            raw = [_normalise_word(line) for line in f]
    raw = sorted(set(w for w in raw if w))
    # Frequency proxy without a corpus: a word that starts many dictionary
    # entries ("run": runs, runner, running, run's) is a common stem.
    alpha = [w for w in raw if w.isalpha() and w.isascii()]
    alpha_set = set(alpha)
    stems = {}
    for w in raw:
        for k in range(2, len(w) + 1):
            p = w[:k]
            if p in alpha_set:
                stems[p] = stems.get(p, 0) + 1
    words = sorted(alpha, key=lambda w: (-stems.get(w, 0), len(w), w))

    # Word endings common in the dictionary become ##pieces.
    endings = {}
    for w in alpha:
        for k in range(2, 5):
            if len(w) > k + 1:
                endings[w[-k:]] = endings.get(w[-k:], 0) + 1
    top_endings = sorted(endings, key=lambda e: (-endings[e], e))[:1500]

    budget = VOCAB_SIZE - len(vocab)
    n_endings = min(len(top_endings), budget // 20)
    for e in sorted(top_endings[:n_endings]):
        add("##" + e)
    for w in words:
        if len(vocab) >= VOCAB_SIZE:
            break
        add(w)

    # Without a word list (or a short one), pad with generated letter pieces.
    letters = "abcdefghijklmnopqrstuvwxyz"
    generated = ([a + b for a in letters for b in letters]
                 + ["##" + a + b for a in letters for b in letters]
                 + [a + b + c for a in letters for b in letters for c in letters]
                 + ["##" + a + b + c for a in letters for b in letters for c in letters])
    for tok in generated:
        if len(vocab) >= VOCAB_SIZE:
            break
        add(tok)
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    return vocab


# --------------------------------------------------------------------------
# Export.


def pool(hidden, mask, pooling="mean", normalize=True):
    if pooling == "cls":
        out = hidden[:, 0]
    else:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if normalize:
        out = nn.functional.normalize(out, p=2, dim=-1)
    return out


def check_dynamic_shapes(traced, eager, vocab_size):
    """The traced graph must not have baked in the example's shapes."""
    g = torch.Generator().manual_seed(7)
    for b, t in [(1, 1), (1, 5), (3, 40), (8, 128), (2, 512)]:
        ids = torch.randint(1000, vocab_size, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.int64)
        if b > 1 and t > 2:
            mask[-1, t // 2:] = 0
            ids[-1, t // 2:] = 0
        got, want = traced(ids, mask), eager(ids, mask)
        if got.shape != (b, t, want.shape[-1]):
            raise RuntimeError(f"traced model returned {tuple(got.shape)} for {(b, t)}")
        err = (got - want).abs().max().item()
        if err > 1e-4:
            raise RuntimeError(f"traced model differs from eager by {err} at {(b, t)}")


def reference(traced, spec):
    pooling, normalize = spec.get("pooling", "mean"), spec.get("normalize", True)
    embeddings = []
    for ids in REFERENCE_INPUTS:
        x = torch.tensor([ids], dtype=torch.int64)
        m = torch.ones_like(x)
        embeddings.append(pool(traced(x, m), m, pooling, normalize)[0].tolist())
    return {
        "description": "embeddings of each input run alone (no padding)",
        "generator_version": GENERATOR_VERSION,
        "torch_version": torch.__version__,
        "pooling": pooling,
        "normalize": normalize,
        "tolerance": 1e-4,
        "inputs": [{"input_ids": ids} for ids in REFERENCE_INPUTS],
        "embeddings": embeddings,
    }


def dump_reference(ref):
    """JSON with one line per input and per embedding, for readable diffs."""
    out = []
    for key, value in ref.items():
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(v) for v in value)
            out.append(f'"{key}": [\n  {rows}\n ]')
        else:
            out.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(out) + "\n}\n"


def stamp_text(name, arch, vocab_lines):
    digest = hashlib.sha256("\n".join(vocab_lines).encode()).hexdigest()
    # Any change to this script (weights, tracing, heads, the reference
    # inputs) makes every model again, not only a bumped version.
    with open(os.path.abspath(__file__), "rb") as f:
        generator = hashlib.sha256(f.read()).hexdigest()
    return json.dumps({"generator_version": GENERATOR_VERSION, "name": name,
                       "arch": arch, "vocab_sha256": digest,
                       "generator_sha256": generator}, sort_keys=True)


def reference_matches(mdir, spec):
    """Whether reference.json was made with the spec's pooling and
    normalisation (the stamp does not cover them: edited, the reference is
    made again)."""
    try:
        with open(os.path.join(mdir, "reference.json")) as f:
            ref = json.load(f)
    except (OSError, ValueError):
        return False
    return (ref.get("pooling") == spec.get("pooling", "mean")
            and ref.get("normalize") == spec.get("normalize", True))


def write_atomic(path, data, mode="w"):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, mode) as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def model_spec(name):
    """shoal.json for `name`: the committed file if there is one."""
    path = os.path.join(REPO_MODELS_DIR, name, "shoal.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f), path
    return {"name": name, "task": "embed", "runtime": "torchscript",
            "model_file": "model.pt", "max_seq_len": 256,
            "dim": MODELS[name]["dim"], "pooling": "mean", "normalize": True,
            "intra_op_threads": 0,
            "tokenizer": {"type": "wordpiece", "vocab_file": "vocab.txt",
                          "lowercase": True, "strip_accents": True},
            "batching": {"max_batch_tokens": 8192, "max_batch_size": 64,
                         "max_wait_us": 2000}}, None


def make_model(out_dir, name, vocab_lines, force):
    arch = dict(COMMON, **MODELS[name])
    mdir = os.path.join(out_dir, name)
    os.makedirs(mdir, exist_ok=True)
    spec, spec_path = model_spec(name)
    shoal_json = os.path.join(mdir, "shoal.json")
    if not os.path.exists(shoal_json):
        if spec_path:
            shutil.copyfile(spec_path, shoal_json)
        else:
            write_atomic(shoal_json, json.dumps(spec, indent=2) + "\n")

    stamp_path = os.path.join(mdir, ".stamp")
    artifacts = [os.path.join(mdir, f) for f in
                 (spec.get("model_file", "model.pt"), "vocab.txt", "reference.json")]
    stamp = stamp_text(name, arch, vocab_lines)
    if (not force and all(os.path.exists(p) for p in artifacts)
            and os.path.exists(stamp_path) and open(stamp_path).read() == stamp
            and reference_matches(mdir, spec)):
        print(f"{name}: up to date in {mdir}")
        return

    model = BertEncoder(arch)
    init_weights(model, arch["seed"])
    model.eval()
    example_ids = torch.randint(1000, VOCAB_SIZE, (2, 16),
                                generator=torch.Generator().manual_seed(1))
    example_mask = torch.ones(2, 16, dtype=torch.int64)
    example_mask[1, 10:] = 0
    with torch.no_grad():
        traced = torch.jit.trace(model, (example_ids, example_mask))
        model_path = artifacts[0]
        tmp = model_path + ".tmp"
        traced.save(tmp)
        loaded = torch.jit.load(tmp)
        loaded.eval()
        check_dynamic_shapes(loaded, model, VOCAB_SIZE)
        ref = reference(loaded, spec)
    os.replace(tmp, model_path)
    write_atomic(artifacts[1], "\n".join(vocab_lines) + "\n")
    write_atomic(artifacts[2], dump_reference(ref))
    write_atomic(stamp_path, stamp)
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params / 1e6:.1f}M params, "
          f"{os.path.getsize(model_path) / 1e6:.1f} MB -> {mdir}")


def eager_module_source(arch):
    """model.py for the Python runtime: the classes above, their weights."""
    parts = [
        '"""Generated by scripts/make_models.py: a BERT encoder in eager PyTorch,\n'
        'served by Shoal\'s Python runtime (runtimes/python/shoal_runtime.py)."""\n',
        "import math\nimport os\n\nimport torch\nfrom torch import nn\n",
        f"ARCH = {json.dumps(arch, sort_keys=True)}\n",
    ]
    for obj in (Embeddings, SelfAttention, SelfOutput, Attention, Intermediate, Output, Layer,
                Encoder, BertEncoder, pool):
        parts.append(inspect.getsource(obj))
    parts.append('''
class EagerEmbedder:
    """What the runtime's load() returns: dim, embed(), memory_bytes()."""

    def __init__(self, model_dir, config):
        self.model = BertEncoder(ARCH)
        weights = os.path.join(model_dir, config.get("model_file", "weights.pt"))
        self.model.load_state_dict(torch.load(weights, map_location="cpu"))
        self.model.eval()
        self.pooling = config.get("pooling", "mean")
        self.normalize = bool(config.get("normalize", True))
        self.dim = ARCH["hidden"]

    def embed(self, ids, mask):
        return pool(self.model(ids, mask), mask, self.pooling, self.normalize)

    def memory_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())


def load(model_dir, config):
    return EagerEmbedder(model_dir, config)
''')
    return "\n\n".join(parts)


def make_python_model(out_dir, name, vocab_lines, force):
    """An eager-mode model for the Python runtime: weights.pt (state_dict),
    model.py, a copy of the runtime script, vocab.txt, reference.json."""
    base = PYTHON_MODELS[name]
    arch = dict(COMMON, **MODELS[base])
    mdir = os.path.join(out_dir, name)
    os.makedirs(mdir, exist_ok=True)
    spec, spec_path = model_spec(name)
    shoal_json = os.path.join(mdir, "shoal.json")
    if not os.path.exists(shoal_json) and spec_path:
        shutil.copyfile(spec_path, shoal_json)
    with open(PYTHON_RUNTIME) as f:
        runtime_src = f.read()
    source = eager_module_source(arch)
    files = {"model.py": source, "shoal_runtime.py": runtime_src, "vocab.txt": "\n".join(vocab_lines) + "\n"}
    stamp = stamp_text(name, arch, vocab_lines) + hashlib.sha256((source + runtime_src).encode()).hexdigest()
    stamp_path = os.path.join(mdir, ".stamp")
    paths = [os.path.join(mdir, f) for f in list(files) + ["weights.pt", "reference.json"]]
    if (not force and all(os.path.exists(p) for p in paths)
            and os.path.exists(stamp_path) and open(stamp_path).read() == stamp
            and reference_matches(mdir, spec)):
        print(f"{name}: up to date in {mdir}")
        return
    model = BertEncoder(arch)
    init_weights(model, arch["seed"])
    model.eval()
    tmp = os.path.join(mdir, "weights.pt.tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, os.path.join(mdir, "weights.pt"))
    for fname, text in files.items():
        write_atomic(os.path.join(mdir, fname), text)
    with torch.no_grad():
        write_atomic(os.path.join(mdir, "reference.json"), dump_reference(reference(model, spec)))
    write_atomic(stamp_path, stamp)
    print(f"{name}: eager {base} for the Python runtime -> {mdir}")


# Fixed segment pairs for a head model's reference.json: (first, second)
# ids without special tokens; framed as [CLS] a [SEP] b [SEP].
REFERENCE_PAIRS = [
    ([7592, 1010, 2088], [2088, 999]),
    ([1996, 4248, 2829, 4419], [14523, 2058, 1996, 13971, 3899, 1012]),
    ([1000 + (i * 7919) % 29000 for i in range(20)], [2000 + (i * 104729) % 28000 for i in range(25)]),
]


def frame_pair(a, b):
    ids = [101] + a + [102] + b + [102]
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    return ids, types


def make_head_model(out_dir, name, vocab_lines, force):
    """A BERT sequence-classification model in TorchScript with three
    inputs (ids, mask, token types); reference.json holds its raw logits for
    REFERENCE_PAIRS."""
    arch = dict(COMMON, **HEAD_MODELS[name])
    mdir = os.path.join(out_dir, name)
    os.makedirs(mdir, exist_ok=True)
    shoal_json = os.path.join(mdir, "shoal.json")
    if not os.path.exists(shoal_json):
        shutil.copyfile(os.path.join(REPO_MODELS_DIR, name, "shoal.json"), shoal_json)
    stamp_path = os.path.join(mdir, ".stamp")
    artifacts = [os.path.join(mdir, f) for f in ("model.pt", "vocab.txt", "reference.json")]
    stamp = stamp_text(name, arch, vocab_lines)
    if (not force and all(os.path.exists(p) for p in artifacts)
            and os.path.exists(stamp_path) and open(stamp_path).read() == stamp):
        print(f"{name}: up to date in {mdir}")
        return
    model = BertForSequenceClassification(arch)
    init_weights(model, arch["seed"])
    # A wider pooler and head than BERT's 0.02 so that random weights still
    # spread the scores over (0, 1) instead of bunching them together.
    torch.manual_seed(arch["seed"] + 1)
    nn.init.normal_(model.bert.pooler.dense.weight, std=0.3)
    nn.init.normal_(model.classifier.weight, std=0.3)
    model.eval()
    ids, types = frame_pair(*REFERENCE_PAIRS[1])
    example = (torch.tensor([ids, ids]), torch.ones(2, len(ids), dtype=torch.int64), torch.tensor([types, types]))
    example[1][1, 8:] = 0
    with torch.no_grad():
        traced = torch.jit.trace(model, example)
        tmp = artifacts[0] + ".tmp"
        traced.save(tmp)
        loaded = torch.jit.load(tmp)
        loaded.eval()
        g = torch.Generator().manual_seed(7)
        for b, t in [(1, 3), (3, 40), (2, 256)]:
            x = torch.randint(1000, VOCAB_SIZE, (b, t), generator=g)
            m = torch.ones(b, t, dtype=torch.int64)
            tt = (torch.arange(t) >= t // 2).long().expand(b, t).contiguous()
            err = (loaded(x, m, tt) - model(x, m, tt)).abs().max().item()
            if err > 1e-4:
                raise RuntimeError(f"traced {name} differs from eager by {err} at {(b, t)}")
        pairs, logits = [], []
        for a, bb in REFERENCE_PAIRS:
            ids, types = frame_pair(a, bb)
            x, tt = torch.tensor([ids]), torch.tensor([types])
            logits.append(loaded(x, torch.ones_like(x), tt)[0].tolist())
            pairs.append({"input_ids": ids, "token_type_ids": types})
    ref = {"description": "raw logits of each framed pair run alone (no activation)",
           "generator_version": GENERATOR_VERSION, "torch_version": torch.__version__,
           "tolerance": 1e-4, "inputs": pairs, "logits": logits}
    os.replace(tmp, artifacts[0])
    write_atomic(artifacts[1], "\n".join(vocab_lines) + "\n")
    write_atomic(artifacts[2], dump_reference(ref))
    write_atomic(stamp_path, stamp)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{arch['num_labels']} label(s) -> {mdir}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="model repository directory")
    ap.add_argument("--only", action="append", default=[],
                    help="model to build (tiny, minilm, or a full name); repeatable")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args(argv)

    known = list(MODELS) + list(PYTHON_MODELS) + list(HEAD_MODELS)
    names = [ALIASES.get(n, n) for n in args.only] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {sorted(known)} or {sorted(ALIASES)}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    vocab = build_vocab()
    for name in names:
        if name in PYTHON_MODELS:
            make_python_model(os.path.abspath(args.out), name, vocab, args.force)
        elif name in HEAD_MODELS:
            make_head_model(os.path.abspath(args.out), name, vocab, args.force)
        else:
            make_model(os.path.abspath(args.out), name, vocab, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
