#!/usr/bin/env python3
"""Builds the small random-weight model folders under tests/data/models/ and their
reference outputs, with the pinned versions of scripts/models/requirements-testmodels.txt.

    python3 -m venv /tmp/tmvenv
    /tmp/tmvenv/bin/pip install -r scripts/models/requirements-testmodels.txt
    /tmp/tmvenv/bin/python scripts/models/make-test-models.py

Deterministic: weights come from numpy's PCG64 with fixed seeds, tokenizers are
trained single-threaded on the text below, torch runs on one CPU thread, and every
JSON file is written with a fixed key order, so two runs on one machine give
byte-identical files. The script deletes and rewrites tests/data/models/ whole.

Every folder is written by the library's own save (`save_pretrained`,
`SentenceTransformer.save`, `CrossEncoder.save`); the folders in an *older* format
(bert-st-old, mpnet-st, the two legacy cross-encoders) are then given the files those
older releases wrote (their sentence_bert_config.json, 1_Pooling/config.json,
modules.json, config_sentence_transformers.json, tokenizer_config.json). Every
reference is computed from the folder as reloaded from disk, and the script checks:

* the token ids equal those of `tokenizers.Tokenizer.from_file(tokenizer.json)` with
  its own padding/truncation replaced by sentence-transformers' (and `Lowercase`
  prepended where sentence_bert_config.json says do_lower_case);
* an independent float64 numpy forward pass written from
  docs/notes/sentence-transformers-folders.md (embeddings, position ids, MPNet's
  relative bias, attention, pooling, Dense, Normalize, classifier heads) agrees with
  sentence-transformers on every case (for Qwen3 and Gemma 3, written from transformers
  5.24's modeling_qwen3.py / modeling_gemma3.py and masking_utils.py: np_decoder);
* a batched encode equals the per-text one.
"""
from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ["TQDM_DISABLE"] = "1"

import argparse
import importlib.metadata
import io
import json
import math
import shutil
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import sentencepiece as spm  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertModel,
    DistilBertTokenizer,
    GPT2Config,
    GteConfig,
    GteModel,
    GPT2Model,
    GPT2Tokenizer,
    Gemma3TextConfig,
    Gemma3TextModel,
    GemmaTokenizer,
    ModernBertConfig,
    ModernBertModel,
    MPNetConfig,
    MPNetModel,
    PreTrainedTokenizerFast,
    MPNetTokenizer,
    NomicBertConfig,
    NomicBertModel,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
    XLMRobertaTokenizer,
)

transformers.logging.set_verbosity_error()

from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder  # noqa: E402
from sentence_transformers.sparse_encoder.modules import SpladePooling  # noqa: E402
from sentence_transformers.sentence_transformer.modules import (  # noqa: E402
    Dense,
    LayerNorm,
    Normalize,
    Pooling,
    Transformer,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "models"
PINNED = {
    "torch": "2.15.0",
    "transformers": "5.24.0",
    "sentence-transformers": "6.2.0",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
    "numpy": "2.4.6",
    "sentencepiece": "0.2.3",
}

# ---------------------------------------------------------------------------------------------
# Text. CORPUS trains the small tokenizers; the test cases below use some words that are in it
# and some that are not (so [UNK]/<unk> and sub-word splits both occur).
# ---------------------------------------------------------------------------------------------
CORPUS = """\
The quick brown fox jumps over the lazy dog. A man is playing a guitar on the street.
Machine learning models turn sentences into vectors, and similar sentences get similar vectors.
How do I reset my password? Click the link in the email we sent you and choose a new password.
The weather is lovely today. It is so sunny outside that we walked to the park by the river.
He drove to the stadium to watch the football match with his friends from school.
Berlin has a population of about three and a half million people and many museums.
Paris is the capital and largest city of France, famous for its art, food and history.
The train to London leaves at nine in the morning and arrives shortly after noon.
Graph replay removes the launch overhead of small kernels; the GPU then does the real work.
A request is padded to the smallest bucket that holds it, and long requests run eagerly.
Reading a model folder exactly as the library reads it is harder than it looks.
Search engines rank passages for a query; a cross-encoder reads the query and passage together.
Questions and answers: what is the capital of Italy? Rome is the capital of Italy.
The cat sat on the mat while the children played in the garden behind the old house.
Scientists discovered a new species of frog in the rainforest last year.
Please send me the report before Friday so that we can review the numbers together.
Numbers such as 2024, 3.14159 and 42 appear in text, as do dates like 1 January 2025.
Le renard brun rapide saute par-dessus le chien paresseux. Il fait beau aujourd'hui à Paris.
La ville de Montréal est connue pour ses festivals, son café et ses hivers très froids.
Où se trouve la gare ? Elle est à côté de l'hôtel de ville, près du marché.
Der schnelle braune Fuchs springt über den faulen Hund. Die Straße ist heute sehr ruhig.
Ich möchte ein Glas Wasser und ein Stück Kuchen, bitte. Das Wetter in München ist schön.
Die Grüße aus Köln kamen spät, aber die Freude über die Nachricht war groß.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?
Mañana vamos a la playa con nuestros amigos de la universidad de Sevilla.
A cidade de São Paulo é a maior do Brasil, e o café da manhã lá é delicioso.
Il treno per Roma parte alle nove; la città è famosa per la sua storia e la sua cucina.
Быстрая коричневая лиса прыгает через ленивую собаку. Москва — столица России.
Сегодня хорошая погода, и мы гуляем в парке у реки.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Η Αθήνα είναι η πρωτεύουσα.
我喜欢自然语言处理。北京是中国的首都。今天天气很好，我们去公园散步。
机器学习模型把句子变成向量，相似的句子得到相似的向量。
東京は日本の首都です。私は毎朝コーヒーを飲みます。日本語の文章も少し含めます。
서울은 한국의 수도입니다. 오늘 날씨가 정말 좋습니다.
القاهرة هي عاصمة مصر. الطقس جميل اليوم.
दिल्ली भारत की राजधानी है। आज मौसम बहुत अच्छा है।
İstanbul, Türkiye'nin en kalabalık şehridir ve çok güzel bir boğazı vardır.
Kraków i Warszawa to duże miasta w Polsce; żółw je sałatę.
Ærøskøbing ligger på Ærø, og smørrebrød smager godt i København.
"""

LONG_EN = (
    "Sentence encoders read a text, turn every token into a vector, and pool those vectors into "
    "one embedding. Serving them fast means batching requests, padding them to a few fixed shapes "
    "and replaying a captured graph for each shape, while the results stay exactly what the "
    "reference library computes. "
)
LONG_MULTI = (
    "Le renard brun rapide saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt "
    "über den faulen Hund. El rápido zorro marrón salta sobre el perro perezoso. 我喜欢自然语言处理。"
    "東京は日本の首都です。Быстрая коричневая лиса прыгает через ленивую собаку. "
)

ORDINARY = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street.",
    "How do I reset my password?",
    "Graph replay removes the launch overhead of small kernels.",
    "replay the graph",
    "pad to the bucket",
]
HARD = [
    ("empty", ""),
    ("space", " "),
    ("whitespace", "  \t\n  \r\n "),
    ("single-char", "a"),
    ("punctuation", "?!..."),
    ("mixed-case", "HELLO World, MiXeD CaSe Text!"),
    ("accents", "Café naïve résumé — Ærøskøbing, Straße, São Paulo, İstanbul."),
    ("cjk-zh", "我喜欢自然语言处理。"),
    ("cjk-ja", "東京は日本の首都です。"),
    ("hangul", "서울은 한국의 수도입니다."),
    ("emoji", "I love 🍕 and 🚀! 👍🏽 ❤️"),
    ("fullwidth-ligature", "Ｆｕｌｌ－ｗｉｄｔｈ ｔｅｘｔ and the ﬁne ligature ①"),
    ("control-chars", "zero\u200bwidth, bell\u0007, nbsp\u00a0here, soft\u00adhyphen"),
    ("numbers", "The year 2024 had 366 days; π ≈ 3.14159 and 1e-9."),
    ("long-word", "Pneumonoultramicroscopicsilicovolcanoconiosis"),
    ("word-over-100-chars", "ab" * 55 + " end"),
]


def special_text(kind: str) -> str:
    if kind == "bert":
        return "special tokens in text: [CLS] [SEP] [PAD] [MASK] [UNK] end"
    if kind == "qwen":
        return "special tokens in text: <|endoftext|> <|im_start|> <|im_end|> <s> </s> end"
    if kind == "gemma":
        return "special tokens in text: <bos> <eos> <pad> <mask> <unk> <start_of_turn> end"
    return "special tokens in text: <s> </s> <pad> <mask> <unk> end"


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def check_versions() -> dict[str, str]:
    found = {}
    bad = []
    for name, want in PINNED.items():
        have = importlib.metadata.version(name)
        found[name] = have
        if have.split("+")[0] != want:
            bad.append(f"{name} {have} (pinned {want})")
    if bad:
        sys.exit(
            "make-test-models: versions differ from scripts/models/requirements-testmodels.txt: "
            + ", ".join(bad)
        )
    return found


def fmt_float(x: float) -> str:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"non-finite value {x}")
    s = f"{x:.9g}"
    if "e" not in s and "." not in s:
        s += ".0"
    return s


def to_json(v) -> str:
    """JSON with float32 values written to 9 significant digits (exact for f32)."""
    if isinstance(v, dict):
        return "{" + ", ".join(json.dumps(k) + ": " + to_json(x) for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(to_json(x) for x in v) + "]"
    if isinstance(v, (np.ndarray,)):
        return to_json(v.tolist())
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return fmt_float(v)
    return json.dumps(v, ensure_ascii=False)


def write_json(path: Path, obj, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def corpus_lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def build_wordpiece_vocab(specials: list[str], vocab_size: int, lowercase: bool) -> dict[str, int]:
    """A WordPiece vocabulary in BERT's format, built deterministically from CORPUS (the tokenizers
    library's WordPieceTrainer breaks ties through hash maps, so it differs from run to run):
    the specials, every character alone and as ##c, then whole words, word prefixes and ##suffixes
    by frequency (ties by the string)."""
    from collections import Counter

    norm = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    pre = pre_tokenizers.BertPreTokenizer()
    words = Counter()
    for line in corpus_lines():
        for w, _ in pre.pre_tokenize_str(norm.normalize_str(line)):
            words[w] += 1
    chars = sorted({c for w in words for c in w})
    vocab = list(specials) + chars + ["##" + c for c in chars]
    prefixes, suffixes = Counter(), Counter()
    for w, n in words.items():
        for i in range(2, min(len(w), 7)):
            prefixes[w[:i]] += n
            suffixes["##" + w[len(w) - i :]] += n
    by_count = lambda c: [k for k, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))]  # noqa: E731
    room = vocab_size - len(vocab)
    picks = (
        [w for w in by_count(words) if len(w) > 1][: room * 45 // 100]
        + by_count(prefixes)[: room * 25 // 100]
        + by_count(suffixes)[: room * 30 // 100]
    )
    seen = set(vocab)
    for t in picks:
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return {t: i for i, t in enumerate(vocab)}


def train_wordpiece(specials: list[str], unk: str, vocab_size: int, lowercase: bool) -> dict[str, int]:
    assert unk in specials
    return build_wordpiece_vocab(specials, vocab_size, lowercase)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _proto_fields(b: bytes):
    """(field number, value) of a serialized protobuf message (enough for sentencepiece's)."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        f, t = key >> 3, key & 7
        if t == 0:
            v, i = _varint(b, i)
        elif t == 2:
            n, i = _varint(b, i)
            v, i = b[i : i + n], i + n
        elif t == 5:
            v, i = b[i : i + 4], i + 4
        elif t == 1:
            v, i = b[i : i + 8], i + 8
        else:
            raise ValueError(f"wire type {t}")
        yield f, v


def train_sentencepiece(vocab_size: int) -> tuple[bytes, list[tuple[str, float]]]:
    """A SentencePiece Unigram model trained on CORPUS the way XLM-R's was (nmt_nfkc
    normalisation), single-threaded and deterministic. Returns the precompiled nmt_nfkc charsmap
    and the vocabulary in XLM-R's layout, as transformers' XLMRobertaConverter builds it:
    <s>=0 <pad>=1 </s>=2 <unk>=3, then the SentencePiece pieces after its own <unk> <s> </s>
    (ids shifted by the fairseq offset 1), then <mask>."""
    import struct

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        normalization_rule_name="nmt_nfkc",
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    model = buf.getvalue()
    pieces = []
    for f, v in _proto_fields(model):
        if f == 1:  # ModelProto.pieces: SentencePiece {piece = 1; score = 2; type = 3}
            d = {}
            for g, w in _proto_fields(v):
                d[g] = w
            pieces.append((d[1].decode("utf-8"), struct.unpack("<f", d[2])[0] if 2 in d else 0.0, d.get(3, 1)))
    assert [p for p, _, _ in pieces[:3]] == ["<unk>", "<s>", "</s>"], pieces[:3]
    spec = next(v for f, v in _proto_fields(model) if f == 3)  # ModelProto.normalizer_spec
    assert next(v for f, v in _proto_fields(spec) if f == 1) == b"nmt_nfkc"
    charsmap = next(v for f, v in _proto_fields(spec) if f == 2)  # NormalizerSpec.precompiled_charsmap
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p, float(sc)) for p, sc, _ in pieces[3:]]
    vocab.append(("<mask>", 0.0))
    return charsmap, vocab


def train_byte_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's byte alphabet and <|endoftext|>, no merges (enough for a folder that is refused)."""
    del vocab_size
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0}
    for c in alphabet:
        vocab[c] = len(vocab)
    return vocab, []


def greedy_bpe_merges(words: dict[tuple[str, ...], int], n_merges: int, alphabet: set[str] | None = None) -> list[tuple[str, str]]:
    """BPE merges learned by the textbook loop, deterministically (the tokenizers library's
    BpeTrainer is not trusted to break ties the same way on every run): count the adjacent symbol
    pairs of every word weighted by its count, merge the most frequent pair (ties: the
    lexicographically smallest), repeat. Symbols outside `alphabet` (when given) never merge."""
    from collections import Counter

    words = dict(words)
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                if alphabet is None or ((a in alphabet or len(a) > 1) and (b in alphabet or len(b) > 1)):
                    pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode characters in its vocabulary's order (`!` = 0 … then the bytes
    that are not printable, mapped to U+0100 on), as GPT-2's and Qwen's vocabularies begin."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    out = [chr(c) for c in cs]
    assert sorted(out) == sorted(pre_tokenizers.ByteLevel.alphabet())
    return out


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen_tokenizer(model_max_length: int) -> Qwen2Tokenizer:
    """A byte-level BPE in Qwen2/Qwen3's layout, written by transformers' Qwen2Tokenizer (NFC
    normalizer, Qwen2's regex Split then ByteLevel without its own regex, ByteLevel decoder): the 256
    byte symbols in GPT-2's order, 300 merges learned from CORPUS (greedy_bpe_merges), then
    <|endoftext|> <|im_start|> <|im_end|> last. As Qwen3-Embedding's tokenizer.json, the
    post-processor appends <|endoftext|> to every sequence (`$A <|endoftext|>`); eos_token is
    <|im_end|>, pad_token <|endoftext|>, padding side left."""
    probe = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(gpt2_byte_alphabet())}, merges=[])
    bt = probe.backend_tokenizer
    from collections import Counter

    words: Counter = Counter()
    for line in corpus_lines():
        for w, _ in bt.pre_tokenizer.pre_tokenize_str(bt.normalizer.normalize_str(line)):
            words[tuple(w)] += 1
    merges = greedy_bpe_merges(words, 300)
    vocab = {c: i for i, c in enumerate(gpt2_byte_alphabet())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for s in QWEN_SPECIALS:
        vocab[s] = len(vocab)
    eot = vocab["<|endoftext|>"]
    post = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)],
    )
    return Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=["<|im_start|>"],
        model_max_length=model_max_length, padding_side="left", post_processor=post,
        clean_up_tokenization_spaces=False, split_special_tokens=False, errors="replace",
    )


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def gemma_tokenizer(model_max_length: int) -> GemmaTokenizer:
    """A SentencePiece-style BPE with byte fallback in Gemma 3's layout, written by transformers'
    GemmaTokenizer (normalizer Replace " " → "▁", a Split on " " that finds none after it, BPE with
    byte_fallback and fuse_unk, decoder ▁ → space + ByteFallback + Fuse): <pad>=0 <eos>=1 <bos>=2
    <unk>=3 <mask>=4 <start_of_turn>=5 <end_of_turn>=6, <0x00>…<0xFF> = 7…262, then the characters
    seen at least 3 times in CORPUS and 300 merges learned from its ▁-prefixed words (other
    characters, most CJK/Hangul and all emoji, go through byte fallback). The post-processor is
    `<bos> $A <eos>` (add_bos_token and add_eos_token, as EmbeddingGemma's); padding side right."""
    import re
    from collections import Counter

    counts = Counter(c for line in corpus_lines() for c in line.replace(" ", "▁"))
    alphabet = sorted(c for c, n in counts.items() if n >= 3)
    words: Counter = Counter()
    for line in corpus_lines():
        for w in re.findall("▁?[^▁]+", line.replace(" ", "▁")):
            words[tuple(w)] += 1
    merges = greedy_bpe_merges(words, 300, set(alphabet))
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in alphabet:
        vocab.setdefault(c, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return GemmaTokenizer(
        vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=True, padding_side="right",
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"], model_max_length=model_max_length,
    )


# ---------------------------------------------------------------------------------------------
# Weights: every parameter drawn from numpy PCG64 seeded by (model seed, crc32 of its name).
# Larger than a trained model's initialisation so that attention is far from uniform and a
# wrong position id, bias or head layout changes the output clearly.
# ---------------------------------------------------------------------------------------------


def init_weights(model: torch.nn.Module, seed: int) -> None:
    def rng(name: str) -> np.random.Generator:
        return np.random.default_rng([seed, zlib.crc32(name.encode())])

    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                g = rng(full)
                shape = tuple(p.shape)
                if isinstance(mod, torch.nn.LayerNorm):
                    v = (1.0 + 0.1 * g.standard_normal(shape)) if p_name == "weight" else 0.1 * g.standard_normal(shape)
                elif isinstance(mod, torch.nn.Embedding):
                    std = 1.0 if "relative_attention_bias" in full else 0.5
                    v = std * g.standard_normal(shape)
                    if mod.padding_idx is not None:
                        v[mod.padding_idx] = 0.0  # trained models keep the padding row at zero
                elif isinstance(mod, torch.nn.Linear):
                    if p_name == "weight":
                        v = g.standard_normal(shape) / math.sqrt(shape[1])
                    else:
                        v = 0.1 * g.standard_normal(shape)
                elif isinstance(mod, torch.nn.LSTM):
                    v = g.standard_normal(shape) / math.sqrt(shape[-1])
                else:
                    v = 0.1 * g.standard_normal(shape)
                p.copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)))


# ---------------------------------------------------------------------------------------------
# Folder clean-up after the library's save
# ---------------------------------------------------------------------------------------------


def tidy_folder(path: Path) -> None:
    """Drops the generated model card and pins the version block to the release numbers (the
    torch wheel's local tag, e.g. +cu132, depends on which wheel was installed)."""
    readme = path / "README.md"
    if readme.exists():
        readme.unlink()
    cst = path / "config_sentence_transformers.json"
    if cst.exists():
        cfg = read_json(cst)
        if "__version__" in cfg:
            cfg["__version__"] = {k: v.split("+")[0] for k, v in cfg["__version__"].items()}
        write_json(cst, cfg)
    for f in path.rglob("*.json"):
        text = f.read_text(encoding="utf-8")
        assert str(ROOT) not in text and "/tmp/" not in text and "/work/" not in text, f


def old_tokenizer_config(do_lower_case: bool | None, model_max_length: int, cls: str, specials: dict, **extra) -> dict:
    cfg = {}
    if do_lower_case is not None:
        cfg["do_lower_case"] = do_lower_case
    cfg.update(specials)
    cfg.update(extra)
    cfg["model_max_length"] = model_max_length
    cfg["tokenizer_class"] = cls
    return cfg


def old_modules(with_normalize: bool) -> list[dict]:
    mods = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if with_normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    return mods


def write_vocab_txt(path: Path, vocab: dict[str, int]) -> None:
    ordered = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in ordered] == list(range(len(ordered)))
    path.write_text("".join(t + "\n" for t, _ in ordered), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Building the folders
# ---------------------------------------------------------------------------------------------

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_SPECIAL_MAP = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}


def build_bert_st_old(tmp: Path) -> Path:
    """BERT in the sentence-transformers 2.x layout, cased WordPiece + do_lower_case=true."""
    vocab = train_wordpiece(BERT_SPECIALS, "[UNK]", 1400, lowercase=False)
    tok = BertTokenizer(vocab=vocab, do_lower_case=False, model_max_length=512)
    # tokenizer.json files of that era carried the tokenizers library's own truncation/padding
    # (all-MiniLM-L6-v2's: 128 and Fixed(128)); sentence-transformers overrides both.
    tok.backend_tokenizer.enable_truncation(max_length=128, strategy="longest_first")
    tok.backend_tokenizer.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
    )
    model = BertModel(cfg)
    init_weights(model, 1001)
    hf = tmp / "bert-st-old-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(32, "mean"), Normalize()], device="cpu")
    path = OUT / "bert-st-old"
    st.save(str(path))
    # The files sentence-transformers 2.x wrote:
    write_json(path / "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": True})
    write_json(path / "modules.json", old_modules(with_normalize=True))
    shutil.rmtree(path / "2_Normalize", ignore_errors=True)  # 2.x wrote no folder for Normalize
    write_json(
        path / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": 32,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    )
    write_json(
        path / "config_sentence_transformers.json",
        {"__version__": {"sentence_transformers": "2.0.0", "transformers": "4.6.1", "pytorch": "1.8.1"}},
    )
    write_json(
        path / "tokenizer_config.json",
        old_tokenizer_config(False, 512, "BertTokenizer", BERT_SPECIAL_MAP, tokenize_chinese_chars=True,
                             strip_accents=None, do_basic_tokenize=True, never_split=None),
    )
    write_json(path / "special_tokens_map.json", BERT_SPECIAL_MAP)
    write_vocab_txt(path / "vocab.txt", vocab)
    tidy_folder(path)
    return path


def uncased_bert_vocab() -> dict[str, int]:
    return train_wordpiece(BERT_SPECIALS, "[UNK]", 1600, lowercase=True)


def build_bert_st_new(tmp: Path) -> Path:
    """BERT saved by sentence-transformers 6.2: only model_max_length=128 limits the length,
    CLS pooling with include_prompt=false, a Dense(32->24, Tanh), Normalize, prompts."""
    vocab = uncased_bert_vocab()
    tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=128)
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
    )
    model = BertModel(cfg)
    init_weights(model, 1002)
    hf = tmp / "bert-st-new-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    dense = Dense(32, 24, bias=True, activation_function=torch.nn.Tanh())
    init_weights(dense, 1003)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "cls", include_prompt=False), dense, Normalize()],
        prompts={
            "query": "query: ",
            "document": "",
            "instruct": "Represent this sentence for searching relevant passages: ",
        },
        default_prompt_name="query",
        device="cpu",
    )
    path = OUT / "bert-st-new"
    st.save(str(path))
    tidy_folder(path)
    return path


def build_distilbert_st(tmp: Path) -> Path:
    """DistilBERT (DistilBertModel: no token types, sa_layer_norm / output_layer_norm, q_lin ...
    out_lin, ffn.lin1 / lin2) saved by sentence-transformers 6.2 with a DistilBertTokenizer
    (uncased WordPiece, model_max_length 96 of 512 positions), mean pooling, Normalize and a
    `query: ` prompt (no default)."""
    vocab = uncased_bert_vocab()
    tok = DistilBertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=96)
    cfg = DistilBertConfig(
        vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=128,
        max_position_embeddings=512, activation="gelu", pad_token_id=0,
    )
    model = DistilBertModel(cfg)
    init_weights(model, 1101)
    hf = tmp / "distilbert-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "mean"), Normalize()],
        prompts={"query": "query: ", "document": ""},
        device="cpu",
    )
    path = OUT / "distilbert-st"
    st.save(str(path))
    tidy_folder(path)
    return path


def build_splade(tmp: Path, name: str, family: str, strategy: str, activation: str, seed: int) -> Path:
    """A SPLADE SparseEncoder saved by sentence-transformers 6.2: a masked-LM model (its head's
    decoder tied to the word embeddings, so not saved) in a `fill-mask` Transformer module, then
    SpladePooling(strategy, activation)."""
    vocab = uncased_bert_vocab()
    if family == "bert":
        tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=96)
        cfg = BertConfig(
            vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
        )
        model = BertForMaskedLM(cfg)
    else:
        tok = DistilBertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=96)
        cfg = DistilBertConfig(
            vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            max_position_embeddings=512, activation="gelu", pad_token_id=0,
        )
        model = DistilBertForMaskedLM(cfg)
    init_weights(model, seed)
    hf = tmp / f"{name}-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    se = SparseEncoder(
        modules=[Transformer(str(hf), transformer_task="fill-mask"),
                 SpladePooling(pooling_strategy=strategy, activation_function=activation)],
        device="cpu",
    )
    path = OUT / name
    se.save(str(path))
    tidy_folder(path)
    return path


def save_safetensors(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata={"format": "pt"})


def nomic_hub_tensors(sd: dict, layers: int) -> dict:
    """transformers 5's NomicBertModel state dict in the Hub remote code's names: `emb_ln`,
    `encoder.layers.N.attn.Wqkv` ([q; k; v]), `attn.out_proj`, `mlp.fc11` (up), `mlp.fc12`
    (gate), `mlp.fc2`, `norm1`, `norm2`."""
    out = {"embeddings.word_embeddings.weight": sd["embeddings.word_embeddings.weight"],
           "embeddings.token_type_embeddings.weight": sd["embeddings.token_type_embeddings.weight"]}
    for n in ("weight", "bias"):
        out[f"emb_ln.{n}"] = sd[f"embeddings.LayerNorm.{n}"]
    for l in range(layers):
        a, b = f"layers.{l}.", f"encoder.layers.{l}."
        out[b + "attn.Wqkv.weight"] = torch.cat([sd[a + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[b + "attn.out_proj.weight"] = sd[a + "self_attn.o_proj.weight"]
        out[b + "mlp.fc11.weight"] = sd[a + "mlp.up_proj.weight"]
        out[b + "mlp.fc12.weight"] = sd[a + "mlp.gate_proj.weight"]
        out[b + "mlp.fc2.weight"] = sd[a + "mlp.down_proj.weight"]
        for n in ("weight", "bias"):
            out[b + f"norm1.{n}"] = sd[a + f"post_attention_layernorm.{n}"]
            out[b + f"norm2.{n}"] = sd[a + f"post_mlp_layernorm.{n}"]
    return out


def build_rotary(tmp: Path, family: str, seed: int) -> tuple[Path, Path]:
    """GTE (GteModel) or NomicBERT (NomicBertModel) from transformers 5, saved by
    sentence-transformers 6.2 (post-norm, rotary positions, gated feed-forward), and the same
    weights in the layout of the Hub's remote code (GTE's `new` model: fused `qkv_proj`,
    `up_gate_proj`, `attn_ln`/`mlp_ln`; NomicBERT's: `Wqkv`, `fc11`/`fc12`/`fc2`, `norm1`/`norm2`,
    `emb_ln`, GPT-2 style config keys). The Hub layout's folder gets the built-in folder's
    reference (same weights, same function)."""
    vocab = uncased_bert_vocab()
    tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=96)
    if family == "gte":
        cfg = GteConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=512, type_vocab_size=1, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        model = GteModel(cfg)
        pooling, prompts = "cls", {"query": "", "document": ""}
    else:
        cfg = NomicBertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=256, max_position_embeddings=512, type_vocab_size=2,
                              pad_token_id=0, layer_norm_eps=1e-5, hidden_act="silu",
                              rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
        model = NomicBertModel(cfg)
        pooling, prompts = "mean", {"search_query": "search_query: ", "search_document": "search_document: "}
    init_weights(model, seed)
    hf = tmp / f"{family}-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(32, pooling), Normalize()],
                             prompts=prompts, device="cpu")
    path = OUT / f"{family}-st"
    st.save(str(path))
    tidy_folder(path)

    # The Hub layout of the same weights.
    hub = OUT / f"{family}-hub-st"
    shutil.copytree(path, hub)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    L = cfg.num_hidden_layers
    if family == "gte":
        rename = {"embeddings.": "embeddings."}
        out["embeddings.word_embeddings.weight"] = sd["embeddings.word_embeddings.weight"]
        out["embeddings.token_type_embeddings.weight"] = sd["embeddings.token_type_embeddings.weight"]
        for n in ("weight", "bias"):
            out[f"embeddings.LayerNorm.{n}"] = sd[f"embeddings.LayerNorm.{n}"]
        for l in range(L):
            a, b = f"layers.{l}.", f"encoder.layer.{l}."
            for n in ("weight", "bias"):
                out[b + f"attention.qkv_proj.{n}"] = torch.cat([sd[a + f"self_attn.{x}_proj.{n}"] for x in "qkv"])
                out[b + f"attention.o_proj.{n}"] = sd[a + f"self_attn.o_proj.{n}"]
                out[b + f"attn_ln.{n}"] = sd[a + f"post_attention_layernorm.{n}"]
                out[b + f"mlp_ln.{n}"] = sd[a + f"post_mlp_layernorm.{n}"]
                out[b + f"mlp.down_proj.{n}"] = sd[a + f"mlp.down_proj.{n}"]
            # new-impl: up_states, gate = split(up_gate_proj(x)): [up | gate]
            out[b + "mlp.up_gate_proj.weight"] = torch.cat([sd[a + "mlp.up_proj.weight"], sd[a + "mlp.gate_proj.weight"]])
        hub_cfg = {
            "architectures": ["NewModel"], "model_type": "new",
            "auto_map": {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
                         "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"},
            "vocab_size": cfg.vocab_size, "hidden_size": 32, "num_hidden_layers": L, "num_attention_heads": 4,
            "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 512, "type_vocab_size": 1,
            "initializer_range": 0.02, "layer_norm_type": "layer_norm", "layer_norm_eps": cfg.layer_norm_eps,
            "position_embedding_type": "rope", "rope_theta": 500.0, "rope_scaling": None,
            "pack_qkv": True, "unpad_inputs": False, "use_memory_efficient_attention": False,
            "logn_attention_scale": False, "logn_attention_clip1": False, "pad_token_id": 0,
            "torch_dtype": "float32", "transformers_version": "4.39.1",
        }
    else:
        out = nomic_hub_tensors(sd, L)
        hub_cfg = {
            "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
            "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                         "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
            "activation_function": "swiglu", "attn_pdrop": 0.0, "bos_token_id": None, "causal": False,
            "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None, "fused_bias_fc": True,
            "fused_dropout_add_ln": True, "initializer_range": 0.02, "layer_norm_epsilon": 1e-5,
            "max_trained_positions": 2048, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "n_embd": 32,
            "n_head": 4, "n_inner": 256, "n_layer": L, "n_positions": 512, "pad_vocab_size_multiple": 1,
            "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": False,
            "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_base": 1000,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
            "rotary_scaling_factor": None, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
            "summary_activation": None, "summary_first_dropout": 0.0, "summary_proj_to_labels": True,
            "summary_type": "cls_index", "summary_use_proj": True, "torch_dtype": "float32",
            "transformers_version": "4.34.0", "type_vocab_size": 2, "use_cache": True, "use_flash_attn": True,
            "use_rms_norm": False, "use_xentropy": True, "vocab_size": cfg.vocab_size,
        }
    (hub / "model.safetensors").unlink()
    save_safetensors(hub / "model.safetensors", out)
    write_json(hub / "config.json", hub_cfg)
    return path, hub


def build_nomic_ntk(tmp: Path, seed: int) -> Path:
    """NomicBERT with dynamic NTK rope scaling in the Hub remote code's layout
    (`rotary_scaling_factor: 2`, `max_trained_positions: 8`, `n_positions: 512`), so that
    most test texts are longer than the trained length and rotate with a larger base. Its
    reference comes from transformers 5's NomicBertModel with `rope_type: dynamic` (the same
    formula, with max_position_embeddings as the trained length), one text at a time in a fresh
    model (its frequencies are per batch and cached across calls)."""
    vocab = uncased_bert_vocab()
    tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=96)
    cfg = NomicBertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=256, max_position_embeddings=8, type_vocab_size=2,
                          pad_token_id=0, layer_norm_eps=1e-5, hidden_act="silu",
                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0})
    model = NomicBertModel(cfg)
    init_weights(model, seed)
    hf = tmp / "nomic-ntk-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf), max_seq_length=96), Pooling(32, "mean"), Normalize()],
                             device="cpu")
    builtin = tmp / "nomic-ntk-builtin"
    st.save(str(builtin))
    path = OUT / "nomic-ntk-hub-st"
    shutil.copytree(builtin, path)
    tidy_folder(path)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = nomic_hub_tensors(sd, cfg.num_hidden_layers)
    (path / "model.safetensors").unlink()
    save_safetensors(path / "model.safetensors", out)
    write_json(path / "config.json", {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
        "activation_function": "swiglu", "attn_pdrop": 0.0, "causal": False, "layer_norm_epsilon": 1e-5,
        "max_trained_positions": 8, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "n_embd": 32, "n_head": 4,
        "n_inner": 256, "n_layer": cfg.num_hidden_layers, "n_positions": 512, "prenorm": False,
        "qkv_proj_bias": False, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": 2.0,
        "type_vocab_size": 2, "use_rms_norm": False, "vocab_size": cfg.vocab_size,
    })
    # One text at a time, each in a fresh model.
    probe = SentenceTransformer(str(builtin), device="cpu")
    probe.max_seq_length = 96
    tok = probe[0].tokenizer
    cases = [c for c in st_cases(tok, "bert", 96, LONG_EN, "", []) if c["case"] != "special-token-strings"]
    rows = []
    W = load_np(path / "model.safetensors")
    hub_cfg = read_json(path / "config.json")
    for c in cases:
        m = SentenceTransformer(str(builtin), device="cpu")
        # sentence-transformers caps the length at max_position_embeddings (8, the trained
        # length here); the Hub folder allows n_positions.
        m.max_seq_length = 96
        m.eval()
        with torch.inference_mode():
            e = m.encode([c["text"]], convert_to_numpy=True, batch_size=1)[0]
        m = SentenceTransformer(str(builtin), device="cpu")  # fresh again: the cache
        m.max_seq_length = 96
        m.eval()
        with torch.inference_mode():
            feats = m.preprocess([c["text"]])
            pooled = m[1](m[0](dict(feats)))["sentence_embedding"][0].float().numpy()
        ids = feats["input_ids"][0].tolist()
        t_ids, _ = tokenizers_crate_ids(path, 96, False, c["text"])
        assert t_ids == ids, (c["case"], t_ids, ids)
        # float64 numpy with the per-sequence base
        h = np_rotary_post(W, dict(hub_cfg, model_type="nomic_bert", layer_norm_eps=1e-5,
                                   num_attention_heads=4, hidden_size=32, num_hidden_layers=cfg.num_hidden_layers,
                                   intermediate_size=256, hidden_act="silu",
                                   rope_parameters={"rope_theta": 1000.0, "factor": 2.0,
                                                    "max_trained": 8}), ids)
        x = h.mean(0)
        x = x / np.linalg.norm(x)
        assert cosine(x, e) > 0.999999, (c["case"], cosine(x, e))
        assert cosine(pooled, e) > 0.999999, c["case"]
        rows.append({"case": c["case"], "text": c["text"], "prompt_name": None, "prompt": None, "ids": ids,
                     "pooled": pooled.tolist(), "embedding": e.tolist()})
    assert sum(len(r["ids"]) > 8 for r in rows) >= len(rows) // 2
    write_reference(path, rows)
    return path


def np_mlm_head(W: dict, cfg: dict, h: np.ndarray) -> np.ndarray:
    """The masked-LM head's logits for hidden states h (float64)."""
    if cfg["model_type"] == "bert":
        t = h @ W["cls.predictions.transform.dense.weight"].T + W["cls.predictions.transform.dense.bias"]
        t = np_ln(np_gelu(t), W["cls.predictions.transform.LayerNorm.weight"],
                  W["cls.predictions.transform.LayerNorm.bias"], cfg["layer_norm_eps"])
        return t @ W["bert.embeddings.word_embeddings.weight"].T + W["cls.predictions.bias"]
    t = h @ W["vocab_transform.weight"].T + W["vocab_transform.bias"]
    t = np_ln(np_gelu(t), W["vocab_layer_norm.weight"], W["vocab_layer_norm.bias"], 1e-12)
    return t @ W["distilbert.embeddings.word_embeddings.weight"].T + W["vocab_projector.bias"]


def splade_reference(path: Path) -> list[dict]:
    """Sparse rows as SparseEncoder.encode gives them (indices ascending, f32 values), every
    case checked against a float64 numpy forward pass (encoder, masked-LM head, SpladePooling)."""
    m = SparseEncoder(str(path), device="cpu")
    m.eval()
    tok = m[0].tokenizer
    max_len = m.max_seq_length
    pool = read_json(path / "1_SpladePooling" / "config.json")
    cases = st_cases(tok, "bert", max_len, LONG_EN, "", [])
    cfg = read_json(path / "config.json")
    fam = family_of(cfg)
    W = load_np(path / "model.safetensors")
    prefix = "bert." if cfg["model_type"] == "bert" else "distilbert."
    rows = []
    with torch.inference_mode():
        emb = m.encode([c["text"] for c in cases], convert_to_tensor=True, batch_size=64).coalesce()
        dense = emb.to_dense().float().numpy()
    for c, vec in zip(cases, dense):
        feats = m.preprocess([c["text"]])
        ids = feats["input_ids"][0].tolist()
        row = {"case": c["case"], "text": c["text"], "ids": ids}
        full = hf_len(tok, c["text"])
        if full > len(ids):
            row["untruncated_length"] = full
        t_ids, _ = tokenizers_crate_ids(path, max_len, True, c["text"])
        assert t_ids == ids, (path.name, c["case"], t_ids, ids)
        nz = np.nonzero(vec)[0]
        row["indices"] = nz.tolist()
        row["values"] = vec[nz].tolist()
        # float64 numpy: encoder, head, log1p(relu) (twice for log1p_relu), max/sum over tokens
        h = np_encoder({k[len(prefix):] if k.startswith(prefix) else k: v for k, v in W.items()},
                       "", fam, cfg, ids, [0] * len(ids) if fam == "bert" else None)
        a = np.log1p(np.maximum(np_mlm_head({**W}, cfg, h), 0))
        if pool["activation_function"] == "log1p_relu":
            a = np.log1p(a)
        x = a.max(0) if pool["pooling_strategy"] == "max" else a.sum(0)
        rel = np.linalg.norm(x - vec) / np.linalg.norm(x)
        assert rel < 1e-4 and (np.nonzero(x > 1e-3 * x.max())[0] == np.nonzero(vec > 1e-3 * x.max())[0]).all(), \
            (path.name, c["case"], rel)
        rows.append(row)
    return rows


def modernbert_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE in ModernBERT's layout: [UNK] [CLS] [SEP] [PAD] [MASK], ByteLevel
    pre-tokenizer without prefix space, `[CLS] $A [SEP]` (`[CLS] $A [SEP] $B [SEP]`)."""
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus_lines(), trainer)
    cls, sep = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", mask_token="[MASK]", model_max_length=model_max_length,
    )


def build_modernbert_st(tmp: Path) -> Path:
    """ModernBERT (ModernBertModel: pre-norm LayerNorms without bias, rotary positions, GeGLU,
    global attention in layers 0 and 3 and a ±4-token sliding window in layers 1 and 2) saved by
    sentence-transformers 6.2 with a byte-level BPE tokenizer, model_max_length 96, mean pooling,
    Normalize and a `query: ` prompt (no default)."""
    tok = modernbert_tokenizer(96)
    cfg = ModernBertConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=512, local_attention=8,
        global_attn_every_n_layers=3,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
    )
    model = ModernBertModel(cfg)
    init_weights(model, 1201)
    hf = tmp / "modernbert-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "mean"), Normalize()],
        prompts={"query": "query: ", "document": ""},
        device="cpu",
    )
    path = OUT / "modernbert-st"
    st.save(str(path))
    tidy_folder(path)
    return path


def xlmr_tokenizer(vocab, charsmap: bytes, model_max_length: int) -> XLMRobertaTokenizer:
    return XLMRobertaTokenizer(vocab=vocab, _spm_precompiled_charsmap=charsmap, model_max_length=model_max_length)


def xlmr_config(vocab_size: int, **kw) -> XLMRobertaConfig:
    return XLMRobertaConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, **kw,
    )


def build_xlmr_st(tmp: Path, uni, charsmap) -> Path:
    tok = xlmr_tokenizer(uni, charsmap, 512)
    model = XLMRobertaModel(xlmr_config(len(uni)))
    init_weights(model, 2001)
    hf = tmp / "xlmr-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "mean"), Normalize()],
        prompts={"query": "query: ", "document": "passage: "},
        device="cpu",
    )
    path = OUT / "xlmr-st"
    st.save(str(path))
    tidy_folder(path)
    return path


def build_mpnet_st(tmp: Path) -> Path:
    """MPNet in the layout all-mpnet-base-v2 has: sentence_bert_config max_seq_length 384 under a
    tokenizer model_max_length of 512, mean pooling, Normalize."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]"]
    vocab = train_wordpiece(specials, "[UNK]", 1400, lowercase=True)
    vocab["<mask>"] = len(vocab)
    tok = MPNetTokenizer(vocab=vocab, do_lower_case=True, unk_token="[UNK]", model_max_length=512,
                         extra_special_tokens=["<unk>"])
    cfg = MPNetConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=514, relative_attention_num_buckets=32,
        layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    model = MPNetModel(cfg)
    init_weights(model, 3001)
    hf = tmp / "mpnet-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(32, "mean"), Normalize()], device="cpu")
    path = OUT / "mpnet-st"
    st.save(str(path))
    write_json(path / "sentence_bert_config.json", {"max_seq_length": 384, "do_lower_case": False})
    write_json(path / "modules.json", old_modules(with_normalize=True))
    shutil.rmtree(path / "2_Normalize", ignore_errors=True)
    # 1_Pooling/config.json as sentence-transformers 2.3-5.x wrote it (all six legacy keys)
    write_json(
        path / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": 32,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False,
            "include_prompt": True,
        },
    )
    write_json(
        path / "config_sentence_transformers.json",
        {
            "__version__": {"sentence_transformers": "2.0.0", "transformers": "4.6.1", "pytorch": "1.8.1"},
        },
    )
    mp_specials = {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]", "sep_token": "</s>",
        "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>",
    }
    write_json(
        path / "tokenizer_config.json",
        old_tokenizer_config(True, 512, "MPNetTokenizer", mp_specials, tokenize_chinese_chars=True,
                             strip_accents=None, additional_special_tokens=["<unk>"]),
    )
    write_json(path / "special_tokens_map.json", {**mp_specials, "additional_special_tokens": ["<unk>"]})
    write_vocab_txt(path / "vocab.txt", vocab)
    tidy_folder(path)
    return path


def minilm_dir() -> Path:
    d = ROOT / "models" / "all-MiniLM-L6-v2"
    if not (d / "tokenizer.json").exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "dev" / "fetch-model.sh")], check=True,
                       env={**os.environ, "PYTHON": sys.executable})
    return d


def build_bert_cross_encoder(tmp: Path) -> Path:
    """BertForSequenceClassification, num_labels=1, saved by CrossEncoder 6.2 with max_length=64;
    the real all-MiniLM-L6-v2 (bert-base-uncased) WordPiece tokenizer, as ms-marco-MiniLM has."""
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    cfg = BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, num_labels=1,
    )
    model = BertForSequenceClassification(cfg)
    init_weights(model, 4001)
    hf = tmp / "bert-ce-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    ce = CrossEncoder(str(hf), max_length=64, device="cpu")
    path = OUT / "bert-cross-encoder"
    ce.save(str(path))
    tidy_folder(path)
    return path


def build_xlmr_cross_encoder(tmp: Path, uni, charsmap) -> Path:
    """XLMRobertaForSequenceClassification with 3 labels (an NLI head): Identity activation,
    raw logits; tokenizer model_max_length 512 = max_position_embeddings 514 - 2."""
    tok = xlmr_tokenizer(uni, charsmap, 512)
    cfg = xlmr_config(
        len(uni), num_labels=3,
        id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
        label2id={"contradiction": 0, "entailment": 1, "neutral": 2},
    )
    model = XLMRobertaForSequenceClassification(cfg)
    init_weights(model, 5001)
    hf = tmp / "xlmr-ce-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    ce = CrossEncoder(str(hf), device="cpu")
    path = OUT / "xlmr-cross-encoder"
    ce.save(str(path))
    tidy_folder(path)
    return path


def build_legacy_cross_encoder(name: str, seed: int, config_keys: dict) -> Path:
    """A cross-encoder as sentence-transformers < 6 saved it: a plain transformers folder (no
    modules.json, no config_sentence_transformers.json), the activation in config.json."""
    vocab = uncased_bert_vocab()
    tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=512)
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, num_labels=1,
    )
    for k, v in config_keys.items():
        setattr(cfg, k, v)
    model = BertForSequenceClassification(cfg)
    init_weights(model, seed)
    path = OUT / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    write_json(
        path / "tokenizer_config.json",
        old_tokenizer_config(True, 512, "BertTokenizer", BERT_SPECIAL_MAP, tokenize_chinese_chars=True,
                             strip_accents=None),
    )
    write_json(path / "special_tokens_map.json", BERT_SPECIAL_MAP)
    write_vocab_txt(path / "vocab.txt", vocab)
    tidy_folder(path)
    return path


def build_unsupported_arch(tmp: Path) -> Path:
    """A GPT-2 (decoder) sentence-transformers folder: valid, loadable, and refused by us."""
    vocab, merges = train_byte_bpe(300)
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=64)
    tok.pad_token = "<|endoftext|>"
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPT2Model(cfg)
    init_weights(model, 6001)
    hf = tmp / "gpt2-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(16, "lasttoken")], device="cpu")
    path = OUT / "unsupported-arch"
    st.save(str(path))
    tidy_folder(path)
    return path


def build_unsupported_module(tmp: Path) -> Path:
    """Transformer -> Pooling -> LayerNorm -> Normalize: sentence-transformers runs the LayerNorm
    module (sentence_transformers.models.LayerNorm) on the pooled vector; we do not implement it,
    so a loader that silently skipped it would return wrong embeddings."""
    vocab = uncased_bert_vocab()
    tok = BertTokenizer(vocab=vocab, do_lower_case=True, model_max_length=128)
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
    )
    model = BertModel(cfg)
    init_weights(model, 7001)
    hf = tmp / "layernorm-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    norm = LayerNorm(16)
    init_weights(norm, 7002)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(16, "mean"), norm, Normalize()], device="cpu")
    path = OUT / "unsupported-module"
    st.save(str(path))
    tidy_folder(path)
    return path


def init_rms_norms(model: torch.nn.Module, seed: int, center: float) -> None:
    """Redraws every RMSNorm weight as center + 0.2·N(0, 1) (Qwen3 multiplies by w, so center 1;
    Gemma 3 by 1 + w, so center 0), so that a norm applied with the wrong convention, or skipped,
    changes the output."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("RMSNorm"):
                g = np.random.default_rng([seed, zlib.crc32(name.encode())])
                v = center + 0.2 * g.standard_normal(tuple(mod.weight.shape))
                mod.weight.copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)))


def sentence_bert_config_legacy(path: Path, max_seq_length: int) -> None:
    """sentence_bert_config.json as Qwen3-Embedding's and EmbeddingGemma's folders have it (written
    by sentence-transformers < 6): the maximum there, under a much larger tokenizer
    model_max_length."""
    write_json(path / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})


QWEN3_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}


def build_qwen3_st(tmp: Path) -> Path:
    """Qwen3 (Qwen3Model) as Qwen3-Embedding: causal, GQA, q_norm/k_norm, bf16 weights in two
    shards, last-token pooling over the appended <|endoftext|>, Normalize, the query instruction."""
    tok = qwen_tokenizer(131072)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, sliding_window=None, max_window_layers=2, attention_bias=False,
        bos_token_id=eot, eos_token_id=eot,
    )
    model = Qwen3Model(cfg)
    init_weights(model, 9001)
    init_rms_norms(model, 9002, 1.0)
    model = model.to(torch.bfloat16)
    hf = tmp / "qwen3-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "lasttoken", include_prompt=True), Normalize()],
        prompts=QWEN3_PROMPTS, default_prompt_name=None, device="cpu",
    )
    assert st[0].auto_model.dtype == torch.bfloat16
    path = OUT / "qwen3-st"
    st.save(str(path))
    # Sharded as the Hub's multi-GB folders are: model-0000N-of-0000M.safetensors and
    # model.safetensors.index.json (transformers' own save, with a small shard size).
    (path / "model.safetensors").unlink()
    st[0].auto_model.save_pretrained(path, max_shard_size="48KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (path / "model.safetensors").exists(), shards
    sentence_bert_config_legacy(path, 64)
    # sentence-transformers saved model_max_length capped at max_position_embeddings (512); the
    # real folder's tokenizer_config.json says 131072, above its 32768 positions.
    tc = read_json(path / "tokenizer_config.json")
    assert tc["model_max_length"] == 512
    tc["model_max_length"] = 131072
    write_json(path / "tokenizer_config.json", tc)
    tidy_folder(path)
    return path


EMBEDDINGGEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ",
    "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ",
    "InstructionRetrieval": "task: code retrieval | query: ",
    "MultilabelClassification": "task: classification | query: ",
    "PairClassification": "task: sentence similarity | query: ",
    "Reranking": "task: search result | query: ",
    "Retrieval": "task: search result | query: ",
    "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ",
    "STS": "task: sentence similarity | query: ",
    "Summarization": "task: summarization | query: ",
}


def build_gemma3_st(tmp: Path) -> Path:
    """Gemma 3 text (Gemma3TextModel) as EmbeddingGemma: bidirectional attention, three sliding
    layers then one global, sandwich norms, bf16 weights; mean pooling, Dense 32→48, Dense 48→32
    (no bias, identity), Normalize, EmbeddingGemma's prompts."""
    tok = gemma_tokenizer(2048)
    cfg = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=12, sliding_window=10,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        use_bidirectional_attention=True, final_logit_softcapping=None, attn_logit_softcapping=None,
        attention_bias=False, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    assert cfg.sliding_window == 6  # 10 // 2 + 1 in memory; to_dict writes (6 - 1) * 2 = 10 back
    model = Gemma3TextModel(cfg)
    init_weights(model, 9101)
    init_rms_norms(model, 9102, 0.0)
    model = model.to(torch.bfloat16)
    hf = tmp / "gemma3-st-hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    d1 = Dense(32, 48, bias=False, activation_function=torch.nn.Identity())
    d2 = Dense(48, 32, bias=False, activation_function=torch.nn.Identity())
    init_weights(d1, 9103)
    init_weights(d2, 9104)
    st = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, "mean"), d1, d2, Normalize()],
        prompts=EMBEDDINGGEMMA_PROMPTS, default_prompt_name=None, device="cpu",
    )
    assert st[0].auto_model.dtype == torch.bfloat16
    path = OUT / "gemma3-st"
    st.save(str(path))
    assert read_json(path / "tokenizer_config.json")["model_max_length"] == 512  # 2048, capped at 512 positions
    sentence_bert_config_legacy(path, 64)
    tidy_folder(path)
    return path


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def hf_len(tok, text: str, pair: str | None = None) -> int:
    enc = tok(text, pair, truncation=False, add_special_tokens=True) if pair is not None else tok(
        text, truncation=False, add_special_tokens=True
    )
    return len(enc["input_ids"])


def repeat_to(tok, base: str, n_tokens: int, prompt: str = "") -> str:
    text = base
    while hf_len(tok, prompt + text) <= n_tokens:
        text += base
    return text.strip()


def exact_length_text(tok, base: str, n_tokens: int, prompt: str = "") -> str:
    """Whole words of a repetition of `base`, topped up with single-token words "the", whose
    tokenization (with `prompt` in front and the special tokens) is exactly n_tokens long."""
    words = repeat_to(tok, base, n_tokens + 40, prompt).split(" ")
    k = 0
    while k < len(words) and hf_len(tok, prompt + " ".join(words[: k + 1])) <= n_tokens:
        k += 1
    text = " ".join(words[:k])
    assert hf_len(tok, prompt + text + " the") == hf_len(tok, prompt + text) + 1
    while hf_len(tok, prompt + text) < n_tokens:
        text += " the"
    assert hf_len(tok, prompt + text) == n_tokens
    return text


def st_cases(tok, kind: str, max_len: int, long_base: str, default_prompt: str, prompt_names: list[str]) -> list[dict]:
    cases = [{"case": f"ordinary-{i + 1}", "text": t, "prompt_name": None} for i, t in enumerate(ORDINARY)]
    cases += [{"case": name, "text": t, "prompt_name": None} for name, t in HARD]
    cases.append({"case": "special-token-strings", "text": special_text(kind), "prompt_name": None})
    for n, name in ((max_len, "exactly-max-length"), (max_len + 1, "max-length-plus-one")):
        cases.append({"case": name, "text": exact_length_text(tok, long_base, n, default_prompt), "prompt_name": None})
    cases.append({"case": "longer-than-max", "text": repeat_to(tok, long_base, max_len + 60, default_prompt), "prompt_name": None})
    for pn in prompt_names:
        cases += [
            {"case": f"prompt-{pn}-ordinary-1", "text": ORDINARY[0], "prompt_name": pn},
            {"case": f"prompt-{pn}-ordinary-3", "text": ORDINARY[2], "prompt_name": pn},
            {"case": f"prompt-{pn}-empty", "text": "", "prompt_name": pn},
            {"case": f"prompt-{pn}-accents", "text": HARD[6][1], "prompt_name": pn},
            {"case": f"prompt-{pn}-longer-than-max", "text": repeat_to(tok, long_base, max_len + 60), "prompt_name": pn},
        ]
    return cases


PAIRS = [
    ("relevant", "How many people live in Berlin?", "Berlin has a population of about three and a half million people."),
    ("irrelevant", "How many people live in Berlin?", "The weather is lovely today."),
    ("capital", "What is the capital of France?", "Paris is the capital and largest city of France."),
    ("identical", "replay the graph", "replay the graph"),
    ("empty-passage", "a query with no passage", ""),
    ("empty-query", "", "a passage with no query"),
    ("both-empty", "", ""),
    ("accents-cjk", "Où se trouve la gare ?", "我喜欢自然语言处理。東京は日本の首都です。Café naïve."),
    ("emoji", "I love 🍕", "🚀 to the moon 👍🏽"),
    ("special-token-strings", "[SEP] </s> in a query", "[CLS] <s> <pad> [PAD] in a passage"),
]


def pair_cases(tok, max_len: int) -> list[dict]:
    cases = [{"case": n, "pair": [q, p]} for n, q, p in PAIRS]
    short_q = "What does a cross-encoder read?"
    longp = repeat_to(tok, LONG_EN, max_len + 40)
    cases.append({"case": "long-passage", "pair": [short_q, longp]})
    cases.append({"case": "long-query", "pair": [longp, "A short passage."]})
    cases.append({"case": "both-long", "pair": [longp, repeat_to(tok, LONG_MULTI, max_len + 40)]})
    # Equal halves over the maximum by an odd count: shows which side loses the odd token.
    half = exact_length_text(tok, LONG_EN, max_len // 2 + 3)  # includes its own specials
    cases.append({"case": "equal-halves-over-max", "pair": [half, half]})
    # A pair exactly at the maximum and one token over it (topped up with single-token "the").
    q = "How long may a pair be?"
    for n, name in ((max_len, "pair-exactly-max"), (max_len + 1, "pair-max-plus-one")):
        words = longp.split(" ")
        k = 0
        while hf_len(tok, q, " ".join(words[: k + 1])) <= n:
            k += 1
        p = " ".join(words[:k])
        while hf_len(tok, q, p) < n:
            p += " the"
        assert hf_len(tok, q, p) == n
        cases.append({"case": name, "pair": [q, p]})
    return cases


# ---------------------------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------------------------


def tokenizers_crate_ids(path: Path, max_len: int, lower: bool, a: str, b: str | None = None):
    """What a reimplementation gets from tokenizer.json alone, once it applies the rules of the
    notes: drop the file's own padding/truncation, truncate longest_first at the resolved maximum,
    and prepend Lowercase when sentence_bert_config.json says do_lower_case."""
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.no_padding()
    tk.enable_truncation(max_length=max_len, strategy="longest_first", stride=0, direction="right")
    if lower:
        tk.normalizer = normalizers.Sequence([normalizers.Lowercase(), tk.normalizer])
    enc = tk.encode(a, b) if b is not None else tk.encode(a)
    return enc.ids, enc.type_ids


def module_list(model) -> list:
    return list(model._modules.values())


def load_st(path: Path) -> SentenceTransformer:
    """SentenceTransformer(folder) on the CPU. A folder whose weights are stored in bfloat16 is
    loaded in float32 (model_kwargs dtype float32: transformers 5 would otherwise keep the saved
    dtype, `dtype="auto"`), so its reference is the float32 function of the stored bf16 values."""
    if read_json(path / "config.json").get("dtype") == "bfloat16":
        m = SentenceTransformer(str(path), device="cpu", model_kwargs={"dtype": torch.float32})
        assert m[0].auto_model.dtype == torch.float32
        return m
    return SentenceTransformer(str(path), device="cpu")


def st_reference(path: Path, kind: str, long_base: str, token_case: str = "ordinary-1",
                 prompt_names: list[str] | None = None, truncate_dims: tuple[int, ...] = (),
                 truncate_cases: tuple[str, ...] = ()) -> list[dict]:
    """Reference rows of a SentenceTransformer folder. prompt_names: the prompts to make cases for
    (default: every non-empty one); truncate_dims: Matryoshka cuts recorded as `truncated` for the
    truncate_cases (what encode(truncate_dim=…) returns)."""
    m = load_st(path)
    m.eval()
    tok = m[0].tokenizer
    max_len = m.max_seq_length
    sbc = read_json(path / "sentence_bert_config.json")
    lower = bool(sbc.get("do_lower_case", False))
    if prompt_names is None:
        prompt_names = [k for k, v in m.prompts.items() if v]
        if m.default_prompt_name:
            prompt_names += [k for k, v in m.prompts.items() if not v and k in ("document",)]
    default_prompt = m.prompts.get(m.default_prompt_name, "") if m.default_prompt_name else ""
    cases = st_cases(tok, kind, max_len, long_base, default_prompt, prompt_names)
    pooling = next(x for x in module_list(m) if isinstance(x, Pooling))
    rows = []
    with torch.inference_mode():
        for c in cases:
            prompt = m._resolve_prompt(None, c["prompt_name"])
            feats = m.preprocess([c["text"]], prompt=prompt)
            row = {"case": c["case"], "text": c["text"], "prompt_name": c["prompt_name"], "prompt": prompt or None}
            ids = feats["input_ids"][0].tolist()
            row["ids"] = ids
            if "token_type_ids" in feats:
                row["type_ids"] = feats["token_type_ids"][0].tolist()
            assert feats["attention_mask"][0].tolist() == [1] * len(ids)
            if "prompt_length" in feats:
                row["prompt_length"] = int(feats["prompt_length"])
            full = hf_len(tok, (prompt or "") + c["text"])  # tok already lowercases where ST does
            if full > len(ids):
                row["untruncated_length"] = full
            # tokenizer.json alone (see tokenizers_crate_ids) must give the same ids
            t_ids, t_types = tokenizers_crate_ids(path, max_len, lower, (prompt or "") + c["text"])
            assert t_ids == ids, (path.name, c["case"], t_ids, ids)
            if "type_ids" in row:
                assert t_types == row["type_ids"]
            x = dict(feats)
            inter = {}
            for mod in module_list(m):
                x = mod(x)
                if isinstance(mod, Transformer):
                    inter["token_embeddings"] = x["token_embeddings"][0].float().numpy().copy()
                elif isinstance(mod, Pooling):
                    inter["pooled"] = x["sentence_embedding"][0].float().numpy().copy()
                elif isinstance(mod, Dense):
                    inter["dense"] = x["sentence_embedding"][0].float().numpy().copy()
            inter["final"] = x["sentence_embedding"][0].float().numpy().copy()
            c["_inter"] = inter
            c["_row"] = row
        # the outputs as encode() gives them: one call per prompt_name, batched
        groups = {}
        for c in cases:
            groups.setdefault(c["prompt_name"], []).append(c)
        for pn, group in groups.items():
            embs = m.encode([c["text"] for c in group], prompt_name=pn, convert_to_numpy=True, batch_size=64)
            assert embs.dtype == np.float32
            for c, e in zip(group, embs):
                assert np.allclose(e, c["_inter"]["final"], atol=2e-6), (path.name, c["case"])
                c["_embedding"] = e
            for dim in truncate_dims:
                sel = [c for c in group if c["case"] in truncate_cases]
                if sel:
                    cut = m.encode([c["text"] for c in sel], prompt_name=pn, convert_to_numpy=True,
                                   batch_size=64, truncate_dim=dim)
                    for c, e in zip(sel, cut):
                        assert e.shape == (dim,) and np.allclose(e, c["_embedding"][:dim], atol=2e-6)
                        c.setdefault("_truncated", {})[str(dim)] = e
    has_dense = any(isinstance(x, Dense) for x in module_list(m))
    has_norm = any(isinstance(x, Normalize) for x in module_list(m))
    for c in cases:
        row = c["_row"]
        if c["case"] == token_case:
            row["token_embeddings"] = c["_inter"]["token_embeddings"].tolist()
        if has_norm or has_dense:
            row["pooled"] = c["_inter"]["pooled"].tolist()
        if has_dense and has_norm:
            row["dense"] = c["_inter"]["dense"].tolist()
        row["embedding"] = c["_embedding"].tolist()
        if "_truncated" in c:
            row["truncated"] = {k: v.tolist() for k, v in c["_truncated"].items()}
        rows.append(row)
    if truncate_dims:
        assert sum("truncated" in r for r in rows) >= 2
    numpy_check_st(path, m, pooling, rows)
    # The folder's own peculiarities must be observable: ignoring do_lower_case or trusting the
    # tokenizer.json's baked truncation must change some ids.
    if lower:
        assert any(tokenizers_crate_ids(path, max_len, False, (r["prompt"] or "") + r["text"])[0] != r["ids"] for r in rows)
    baked = read_json(path / "tokenizer.json").get("truncation")
    if baked and baked["max_length"] != max_len:
        tk = Tokenizer.from_file(str(path / "tokenizer.json"))
        assert any(len(tk.encode(r["text"]).ids) != len(r["ids"]) for r in rows)
    return rows


def ce_reference(path: Path) -> list[dict]:
    ce = CrossEncoder(str(path), device="cpu")
    ce.eval()
    tok = ce[0].tokenizer
    max_len = ce.max_seq_length
    cases = pair_cases(tok, max_len)
    n_labels = ce.num_labels
    pairs = [tuple(c["pair"]) for c in cases]
    with torch.inference_mode():
        scores = ce.predict(pairs, convert_to_numpy=True, batch_size=64)
        logits = ce.predict(pairs, convert_to_numpy=True, batch_size=64, activation_fn=torch.nn.Identity())
        soft = ce.predict(pairs, convert_to_numpy=True, batch_size=64, activation_fn=torch.nn.Identity(),
                          apply_softmax=True) if n_labels > 1 else None
    rows = []
    for i, c in enumerate(cases):
        q, p = c["pair"]
        feats = ce.preprocess([(q, p)])
        row = {"case": c["case"], "pair": [q, p], "ids": feats["input_ids"][0].tolist()}
        if "token_type_ids" in feats:
            row["type_ids"] = feats["token_type_ids"][0].tolist()
        nq = len(tok(q, add_special_tokens=False)["input_ids"])
        np_ = len(tok(p, add_special_tokens=False)["input_ids"])
        specials = hf_len(tok, q, p) - nq - np_
        kept = len(row["ids"]) - specials
        if kept < nq + np_:
            # which tokens survived: recover the split from the post-processor's layout
            t_ids = tokenizers_crate_ids(path, max_len, False, q, p)[0]
            assert t_ids == row["ids"]
            tk = Tokenizer.from_file(str(path / "tokenizer.json"))
            tk.no_padding()
            tk.enable_truncation(max_length=max_len, strategy="longest_first")
            enc = tk.encode(q, p)
            seq = enc.sequence_ids
            kq = sum(1 for s, sp in zip(seq, enc.special_tokens_mask) if s == 0 and not sp)
            kp = sum(1 for s, sp in zip(seq, enc.special_tokens_mask) if s == 1 and not sp)
            row["truncation"] = {"first": {"tokens": nq, "kept": kq}, "second": {"tokens": np_, "kept": kp}}
        t_ids, t_types = tokenizers_crate_ids(path, max_len, False, q, p)
        assert t_ids == row["ids"], (path.name, c["case"])
        if "type_ids" in row:
            assert t_types == row["type_ids"]
        lg = np.atleast_1d(logits[i]).astype(np.float32)
        row["logits"] = lg.tolist()
        sc = scores[i]
        row["score"] = float(sc) if n_labels == 1 else np.asarray(sc, dtype=np.float32).tolist()
        if soft is not None:
            row["softmax"] = np.asarray(soft[i], dtype=np.float32).tolist()
        rows.append(row)
    numpy_check_ce(path, ce, rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Independent float64 forward pass, written from the notes, checked against every reference row
# ---------------------------------------------------------------------------------------------


def load_np(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float64) for k, v in load_file(str(path)).items()}


def np_ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(math.erf)


def np_gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def mpnet_bucket(rel: np.ndarray, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """relative_position_bucket of modeling_mpnet, in float32 as torch computes it."""
    n = -rel
    nb = num_buckets // 2
    ret = (n < 0).astype(np.int64) * nb
    n = np.abs(n)
    max_exact = nb // 2
    with np.errstate(divide="ignore"):
        large = (
            np.log(n.astype(np.float32) / np.float32(max_exact))
            / np.float32(math.log(max_distance / max_exact))
            * np.float32(nb - max_exact)
        )
    large = max_exact + np.where(np.isfinite(large), large, 0).astype(np.int64)  # truncation toward 0
    large = np.minimum(large, nb - 1)
    return ret + np.where(n < max_exact, n, large)


def np_distilbert(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """DistilBERT's forward (modeling_distilbert): BERT's post-norm block under other names,
    positions from 0, no token types, LayerNorm eps fixed at 1e-12."""
    L = len(ids)
    eps = 1e-12
    e = W["embeddings.word_embeddings.weight"][np.asarray(ids)] + W["embeddings.position_embeddings.weight"][np.arange(L)]
    h = np_ln(e, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    H = cfg["n_heads"]
    dh = cfg["dim"] // H
    for layer in range(cfg["n_layers"]):
        p = f"transformer.layer.{layer}."

        def lin(name, x):
            return x @ W[p + name + ".weight"].T + W[p + name + ".bias"]

        q = lin("attention.q_lin", h).reshape(L, H, dh).transpose(1, 0, 2)
        k = lin("attention.k_lin", h).reshape(L, H, dh).transpose(1, 0, 2)
        v = lin("attention.v_lin", h).reshape(L, H, dh).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        s = s - s.max(-1, keepdims=True)
        a = np.exp(s)
        a = a / a.sum(-1, keepdims=True)
        c = (a @ v).transpose(1, 0, 2).reshape(L, H * dh)
        h1 = np_ln(h + lin("attention.out_lin", c), W[p + "sa_layer_norm.weight"], W[p + "sa_layer_norm.bias"], eps)
        inter = np_gelu(lin("ffn.lin1", h1))
        h = np_ln(h1 + lin("ffn.lin2", inter), W[p + "output_layer_norm.weight"], W[p + "output_layer_norm.bias"], eps)
    return h


def np_modernbert(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """ModernBERT's forward (modeling_modernbert) for one unpadded sequence: pre-norm, LayerNorms
    without bias (norm_bias false), rotary "rotate half" per layer kind, local layers seeing keys
    within local_attention/2, GeGLU (act(input) * gate) with exact GELU, final norm."""
    assert not cfg.get("norm_bias") and not cfg.get("attention_bias") and not cfg.get("mlp_bias")
    L = len(ids)
    eps = cfg["norm_eps"]
    H = cfg["num_attention_heads"]
    D = cfg["hidden_size"] // H
    I = cfg["intermediate_size"]

    def ln(x, name):
        return np_ln(x, W[name + ".weight"], np.zeros_like(W[name + ".weight"]), eps)

    def rope(x, theta):  # x: (H, L, D)
        inv = 1.0 / (np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D)))
        ang = (np.arange(L, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
        cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)
        sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)
        rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rot * sin

    h = ln(W["embeddings.tok_embeddings.weight"][np.asarray(ids)], "embeddings.norm")
    window = cfg["local_attention"] // 2
    for layer, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{layer}."
        a = h if layer == 0 else ln(h, p + "attn_norm")
        qkv = (a @ W[p + "attn.Wqkv.weight"].T).reshape(L, 3, H, D)
        q, k, v = (qkv[:, i].transpose(1, 0, 2) for i in range(3))
        theta = cfg["rope_parameters"][kind]["rope_theta"]
        q, k = rope(q, theta), rope(k, theta)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(D)
        if kind == "sliding_attention":
            far = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :]) > window
            s = np.where(far[None], -np.inf, s)
        s = s - s.max(-1, keepdims=True)
        e = np.exp(s)
        c = ((e / e.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(L, H * D)
        h = h + c @ W[p + "attn.Wo.weight"].T
        wi = ln(h, p + "mlp_norm") @ W[p + "mlp.Wi.weight"].T
        h = h + (np_gelu(wi[:, :I]) * wi[:, I:]) @ W[p + "mlp.Wo.weight"].T
    return ln(h, "final_norm")


def np_rotary_post(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """GTE / NomicBERT (transformers 5's GteModel / NomicBertModel) for one unpadded sequence:
    word + token type 0, LayerNorm; per layer q/k/v (bias where saved), rotary "rotate half",
    softmax attention, o, LayerNorm(h + o), act(gate) * up, down, LayerNorm(h + down)."""
    L = len(ids)
    eps = cfg["layer_norm_eps"]
    H = cfg["num_attention_heads"]
    D = cfg["hidden_size"] // H
    theta = cfg["rope_parameters"]["rope_theta"]
    rp = cfg["rope_parameters"]
    if "max_trained" in rp and L > rp["max_trained"]:  # dynamic NTK, for this sequence's length
        f = rp["factor"]
        theta = theta * ((f * L / rp["max_trained"]) - (f - 1)) ** (D / (D - 2))
    act = np_gelu if cfg["hidden_act"] == "gelu" else (lambda x: x / (1 + np.exp(-x)))

    def lin(x, name):
        b = W.get(name + ".bias")
        return x @ W[name + ".weight"].T + (0 if b is None else b)

    def ln(x, name):
        return np_ln(x, W[name + ".weight"], W[name + ".bias"], eps)

    inv = 1.0 / (np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D)))
    ang = (np.arange(L, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)

    def rope(x):  # (H, L, D)
        return x * cos + np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1) * sin

    # transformers 5 saves both in the Hub's tensor names (its conversion mapping, reversed).
    gte = cfg["model_type"] == "gte"
    I = cfg["intermediate_size"]
    h = ln(W["embeddings.word_embeddings.weight"][np.asarray(ids)] + W["embeddings.token_type_embeddings.weight"][0],
           "embeddings.LayerNorm" if gte else "emb_ln")
    for layer in range(cfg["num_hidden_layers"]):
        if gte:
            p = f"encoder.layer.{layer}."
            qkv, o, n1, n2 = p + "attention.qkv_proj", p + "attention.o_proj", p + "attn_ln", p + "mlp_ln"
        else:
            p = f"encoder.layers.{layer}."
            qkv, o, n1, n2 = p + "attn.Wqkv", p + "attn.out_proj", p + "norm1", p + "norm2"
        q, k, v = (x.reshape(L, H, D).transpose(1, 0, 2) for x in np.split(lin(h, qkv), 3, axis=1))
        q, k = rope(q), rope(k)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(D)
        e = np.exp(s - s.max(-1, keepdims=True))
        c = ((e / e.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(L, H * D)
        h = ln(h + lin(c, o), n1)
        if gte:  # new-impl: [up | gate]
            ug = lin(h, p + "mlp.up_gate_proj")
            up, gate, down = ug[:, :I], ug[:, I:], p + "mlp.down_proj"
        else:
            up, gate, down = lin(h, p + "mlp.fc11"), lin(h, p + "mlp.fc12"), p + "mlp.fc2"
        h = ln(h + lin(act(gate) * up, down), n2)
    return h


def np_rms(x, w, eps, one_plus: bool):
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · w (Qwen3), · (1 + w) (Gemma 3)."""
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * (1.0 + w) if one_plus else y * w


def np_rope(x, theta: float, positions: np.ndarray):
    """Rotary "rotate half" on x (heads, L, D), the angles in float32 as transformers computes them."""
    D = x.shape[-1]
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D)))
    ang = (positions.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)
    return x * cos + np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1) * sin


def np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_decoder(W: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """Qwen3 (Qwen3Model) or Gemma 3 text (Gemma3TextModel) for one unpadded sequence, from the
    saved config.json keys alone. Positions 0…L−1. Per layer: pre-norm; q/k/v without bias, q and
    k RMS-normed per head (q_norm/k_norm over head_dim) before rotary; the KV head of query head h
    is h // (heads / kv_heads); softmax(q·k · scale + mask)·v; o_proj.
      Qwen3: RMSNorm · w, scale head_dim^-½, causal mask (use_sliding_window false), residual after
        o_proj and after the SwiGLU MLP silu(gate)·up → down, final norm.
      Gemma 3: embeddings · float32(√hidden) (the compute dtype's rounding), RMSNorm · (1 + w),
        scale query_pre_attn_scalar^-½, rotary θ per layer type (rope_parameters[layer_type]),
        sandwich norms (post_attention_layernorm on the attention output before the residual add,
        pre_/post_feedforward_layernorm around the GeGLU MLP gelu_tanh(gate)·up → down), final norm.
        use_bidirectional_attention: full layers see every token; sliding layers see keys with
        |i − j| < sliding_window // 2 + 1 (sliding_window as saved), i.e. |i − j| ≤ sliding_window // 2."""
    L = len(ids)
    gemma = cfg["model_type"] == "gemma3_text"
    eps = cfg["rms_norm_eps"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pos = np.arange(L)
    h = W["embed_tokens.weight"][np.asarray(ids)]
    if gemma:
        h = h * np.float64(np.float32(math.sqrt(cfg["hidden_size"])))
        scale = cfg["query_pre_attn_scalar"] ** -0.5
        act = np_gelu_tanh
        assert cfg["hidden_activation"] == "gelu_pytorch_tanh"
        assert cfg["attn_logit_softcapping"] is None and cfg["use_bidirectional_attention"]
    else:
        scale = D**-0.5
        act = lambda x: x / (1.0 + np.exp(-x))  # noqa: E731
        assert cfg["hidden_act"] == "silu" and not cfg["use_sliding_window"]
    assert not cfg["attention_bias"]

    def norm(x, name):
        return np_rms(x, W[name + ".weight"], eps, gemma)

    dist = pos[:, None] - pos[None, :]
    for layer, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{layer}."
        a = norm(h, p + "input_layernorm")
        q = (a @ W[p + "self_attn.q_proj.weight"].T).reshape(L, H, D).transpose(1, 0, 2)
        k = (a @ W[p + "self_attn.k_proj.weight"].T).reshape(L, KV, D).transpose(1, 0, 2)
        v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(L, KV, D).transpose(1, 0, 2)
        q, k = norm(q, p + "self_attn.q_norm"), norm(k, p + "self_attn.k_norm")
        rp = cfg["rope_parameters"][kind] if gemma else cfg["rope_parameters"]
        assert rp["rope_type"] == "default"
        q, k = np_rope(q, rp["rope_theta"], pos), np_rope(k, rp["rope_theta"], pos)
        kv_of = np.arange(H) // (H // KV)
        s = q @ k[kv_of].transpose(0, 2, 1) * scale
        if not gemma:
            allowed = dist >= 0
        elif kind == "sliding_attention":
            allowed = np.abs(dist) < cfg["sliding_window"] // 2 + 1
        else:
            allowed = np.ones((L, L), dtype=bool)
        s = np.where(allowed[None], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        c = ((e / e.sum(-1, keepdims=True)) @ v[kv_of]).transpose(1, 0, 2).reshape(L, H * D)
        o = c @ W[p + "self_attn.o_proj.weight"].T
        if gemma:
            h = h + norm(o, p + "post_attention_layernorm")
            m = norm(h, p + "pre_feedforward_layernorm")
        else:
            h = h + o
            m = norm(h, p + "post_attention_layernorm")
        f = (act(m @ W[p + "mlp.gate_proj.weight"].T) * (m @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        h = h + (norm(f, p + "post_feedforward_layernorm") if gemma else f)
    return norm(h, "norm")


def np_encoder(W: dict, prefix: str, family: str, cfg: dict, ids: list[int], type_ids: list[int] | None) -> np.ndarray:
    if family in ("qwen3", "gemma3_text"):
        return np_decoder(W, cfg, ids)
    if family == "distilbert":
        return np_distilbert(W, cfg, ids)
    if family == "modernbert":
        return np_modernbert(W, cfg, ids)
    if family in ("gte", "nomic_bert"):
        return np_rotary_post(W, cfg, ids)
    ids_a = np.asarray(ids)
    L = len(ids)
    e = W[prefix + "embeddings.word_embeddings.weight"][ids_a]
    if family == "bert":
        pos = np.arange(L)
    else:  # XLM-R / MPNet: create_position_ids_from_input_ids, padding_idx = pad id (MPNet: 1)
        pad = 1
        mask = (ids_a != pad).astype(np.int64)
        pos = np.cumsum(mask) * mask + pad
    e = e + W[prefix + "embeddings.position_embeddings.weight"][pos]
    if family in ("bert", "xlmr"):
        tt = np.asarray(type_ids) if type_ids is not None else np.zeros(L, dtype=np.int64)
        e = e + W[prefix + "embeddings.token_type_embeddings.weight"][tt]
    eps = cfg["layer_norm_eps"]
    h = np_ln(e, W[prefix + "embeddings.LayerNorm.weight"], W[prefix + "embeddings.LayerNorm.bias"], eps)
    H = cfg["num_attention_heads"]
    dh = cfg["hidden_size"] // H
    bias = None
    if family == "mpnet":
        ctx = np.arange(L)[:, None]
        mem = np.arange(L)[None, :]
        bucket = mpnet_bucket(mem - ctx)
        bias = W[prefix + "encoder.relative_attention_bias.weight"][bucket].transpose(2, 0, 1)  # (H, L, L)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"{prefix}encoder.layer.{layer}."
        if family == "mpnet":
            nq, nk, nv, no = (p + "attention.attn." + s for s in ("q", "k", "v", "o"))
            nln1 = p + "attention.LayerNorm"
        else:
            nq, nk, nv = (p + "attention.self." + s for s in ("query", "key", "value"))
            no = p + "attention.output.dense"
            nln1 = p + "attention.output.LayerNorm"

        def lin(name, x):
            return x @ W[name + ".weight"].T + W[name + ".bias"]

        q = lin(nq, h).reshape(L, H, dh).transpose(1, 0, 2)
        k = lin(nk, h).reshape(L, H, dh).transpose(1, 0, 2)
        v = lin(nv, h).reshape(L, H, dh).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        if bias is not None:
            s = s + bias
        s = s - s.max(-1, keepdims=True)
        a = np.exp(s)
        a = a / a.sum(-1, keepdims=True)
        c = (a @ v).transpose(1, 0, 2).reshape(L, H * dh)
        h1 = np_ln(h + lin(no, c), W[nln1 + ".weight"], W[nln1 + ".bias"], eps)
        inter = np_gelu(lin(p + "intermediate.dense", h1))
        h = np_ln(h1 + lin(p + "output.dense", inter), W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], eps)
    return h


def family_of(cfg: dict) -> str:
    return {"bert": "bert", "xlm-roberta": "xlmr", "mpnet": "mpnet", "distilbert": "distilbert",
            "modernbert": "modernbert", "gte": "gte", "nomic_bert": "nomic_bert", "qwen3": "qwen3",
            "gemma3_text": "gemma3_text"}[cfg["model_type"]]


def cosine(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def load_np_any(path: Path) -> dict[str, np.ndarray]:
    """load_np for any dtype safetensors stores (bfloat16 is read through torch)."""
    from safetensors.torch import load_file

    return {k: v.float().numpy().astype(np.float64) for k, v in load_file(str(path)).items()}


def load_model_np(path: Path) -> dict[str, np.ndarray]:
    """A folder's transformer weights in float64: model.safetensors, or the shards that
    model.safetensors.index.json's weight_map names."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if not index.exists():
        files = ["model.safetensors"]
    else:
        wm = read_json(index)["weight_map"]
        files = sorted(set(wm.values()))
    W = {}
    for f in files:
        for k, v in load_np_any(path / f).items():
            assert k not in W
            W[k] = v
    if index.exists():
        assert sorted(W) == sorted(wm) and all(k in load_file(str(path / wm[k])) for k in wm)
    return W


NP_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": np.tanh, "torch.nn.modules.linear.Identity": lambda x: x}


def numpy_check_st(path: Path, m, pooling: Pooling, rows: list[dict]) -> None:
    cfg = read_json(path / "config.json")
    fam = family_of(cfg)
    W = load_model_np(path)
    denses = []
    mods = read_json(path / "modules.json")
    for mod in mods:
        if mod["type"].endswith("Dense"):
            D = load_np_any(path / mod["path"] / "model.safetensors")
            dcfg = read_json(path / mod["path"] / "config.json")
            assert ("linear.bias" in D) == dcfg["bias"]
            denses.append((D["linear.weight"], D.get("linear.bias"), NP_ACTIVATIONS[dcfg["activation_function"]]))
    normalize = any(mod["type"].endswith("Normalize") for mod in mods)
    modes = (pooling.pooling_mode,) if isinstance(pooling.pooling_mode, str) else pooling.pooling_mode
    for r in rows:
        h = np_encoder(W, "", fam, cfg, r["ids"], r.get("type_ids"))
        start = r.get("prompt_length", 0) if not pooling.include_prompt else 0
        if start >= len(r["ids"]):
            start = 0
        sel = h[start:]
        parts = []
        for mode in modes:
            if mode == "mean":
                parts.append(sel.mean(0))
            elif mode == "cls":
                parts.append(sel[0])
            elif mode == "max":
                parts.append(sel.max(0))
            elif mode == "lasttoken":
                parts.append(sel[-1])
            else:
                raise AssertionError(mode)
        x = np.concatenate(parts)
        assert cosine(x, r.get("pooled", r["embedding"])) > 0.999999, (path.name, r["case"])
        for w, b, act in denses:
            x = act(w @ x + (0 if b is None else b))
        if denses:
            assert cosine(x, r.get("dense", r["embedding"])) > 0.999999, (path.name, r["case"])
        if normalize:
            x = x / max(np.linalg.norm(x), 1e-12)
        c = cosine(x, r["embedding"])
        rel = np.linalg.norm(x - np.asarray(r["embedding"])) / np.linalg.norm(x)
        assert c > 0.999999 and rel < 1e-4, (path.name, r["case"], c, rel)


def numpy_check_ce(path: Path, ce, rows: list[dict]) -> None:
    cfg = read_json(path / "config.json")
    fam = family_of(cfg)
    W = load_np(path / "model.safetensors")
    prefix = {"bert": "bert.", "xlmr": "roberta."}[fam]
    act = type(ce.activation_fn).__name__
    for r in rows:
        h = np_encoder(W, prefix, fam, cfg, r["ids"], r.get("type_ids"))
        first = h[0]
        if fam == "bert":
            pooled = np.tanh(W["bert.pooler.dense.weight"] @ first + W["bert.pooler.dense.bias"])
            logits = W["classifier.weight"] @ pooled + W["classifier.bias"]
        else:
            x = np.tanh(W["classifier.dense.weight"] @ first + W["classifier.dense.bias"])
            logits = W["classifier.out_proj.weight"] @ x + W["classifier.out_proj.bias"]
        assert np.allclose(logits, r["logits"], atol=1e-4, rtol=1e-4), (path.name, r["case"], logits, r["logits"])
        score = 1.0 / (1.0 + np.exp(-logits)) if act == "Sigmoid" else logits
        assert act in ("Sigmoid", "Identity"), act
        assert np.allclose(np.atleast_1d(score), np.atleast_1d(r["score"]), atol=1e-4), (path.name, r["case"])


ST_REFERENCE_OPTIONS = {
    # EmbeddingGemma's fourteen prompts hold five distinct strings; the query and document ones are enough.
    "gemma3-st": {
        "prompt_names": ["query", "document"],
        "truncate_dims": (16,),
        "truncate_cases": ("ordinary-1", "accents", "cjk-zh", "prompt-query-ordinary-1", "prompt-document-ordinary-1"),
    },
}


def check_decoder_rows(path: Path, kind: str, rows: list[dict]) -> None:
    """What the decoder folders exist to show: Qwen3's tokenizer.json appends <|endoftext|> to every
    text (truncated ones included) and last-token pooling reads it; Gemma's puts <bos> … <eos> around
    every text, some characters go through byte fallback, and texts are longer than the window."""
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = read_json(path / "config.json")
    if kind == "qwen":
        eot = tk.token_to_id("<|endoftext|>")
        assert all(r["ids"][-1] == eot for r in rows)
        assert any(r["ids"].count(eot) > 1 for r in rows)  # the special-token-strings case
        assert any("untruncated_length" in r and r["prompt"] for r in rows)
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    else:
        bos, eos = tk.token_to_id("<bos>"), tk.token_to_id("<eos>")
        assert all(r["ids"][0] == bos and r["ids"][-1] == eos for r in rows)
        byte_ids = {tk.token_to_id(f"<0x{b:02X}>") for b in range(256)}
        assert sum(any(i in byte_ids for i in r["ids"]) for r in rows) >= 5
        assert sum(len(r["ids"]) > cfg["sliding_window"] for r in rows) >= len(rows) // 2
        assert cfg["query_pre_attn_scalar"] != cfg["head_dim"]


def write_reference(path: Path, rows: list[dict]) -> None:
    with open(path / "reference.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(to_json(r) + "\n")


def check_mpnet_buckets() -> None:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    rel = np.arange(-1100, 1101)
    want = MPNetEncoder.relative_position_bucket(torch.from_numpy(rel)).numpy()
    assert (mpnet_bucket(rel) == want).all()


# ---------------------------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------------------------

FOLDERS = {
    "bert-st-old": (
        "BERT (BertModel) in the sentence-transformers 2.x layout: `sentence_bert_config.json` "
        "`{max_seq_length: 256, do_lower_case: true}`, the four-key `1_Pooling/config.json` "
        "(`word_embedding_dimension`, `pooling_mode_*_tokens`), `modules.json` with "
        "`sentence_transformers.models.{Transformer,Pooling,Normalize}` and no `2_Normalize/` folder, "
        "`config_sentence_transformers.json` with only `__version__`, an old-style "
        "`tokenizer_config.json` (`do_lower_case: false`, `model_max_length: 512`) and `vocab.txt`. "
        "The WordPiece tokenizer is **cased** (BertNormalizer lowercase=false) and its tokenizer.json "
        "carries the tokenizers library's own `truncation` (128) and `padding` (Fixed 128), as "
        "all-MiniLM-L6-v2's does: both must be ignored. Resolved maximum: 256 (max_seq_length). "
        "do_lower_case=true makes sentence-transformers prepend a `Lowercase` normalizer, so `HELLO` "
        "and `hello` give the same ids. Mean pooling, Normalize."
    ),
    "bert-st-new": (
        "BERT saved by sentence-transformers 6.2: the only length limit is `model_max_length: 128` in "
        "tokenizer_config.json (position table 512, no `max_seq_length` anywhere). Pooling `cls` with "
        "`include_prompt: false`, `2_Dense` (32→24, bias, `torch.nn.modules.activation.Tanh`, weights in "
        "`2_Dense/model.safetensors`), `3_Normalize`. `config_sentence_transformers.json` has prompts "
        "`query` = `\"query: \"`, `document` = `\"\"`, `instruct` = a long instruction, and "
        "`default_prompt_name: query`, so a plain encode() prepends `\"query: \"`. With "
        "include_prompt=false the first `prompt_length` tokens ([CLS] included) are masked out of pooling, "
        "so \"CLS\" pooling takes the first token after the prompt."
    ),
    "xlmr-st": (
        "XLM-RoBERTa (XLMRobertaModel, position ids from padding_idx+1, type_vocab_size 1) saved by "
        "sentence-transformers 6.2: a SentencePiece-style Unigram tokenizer.json in XLM-R's layout "
        "(`<s>`=0 `<pad>`=1 `</s>`=2 `<unk>`=3 … `<mask>` last; the nmt_nfkc Precompiled normalizer; "
        "WhitespaceSplit + Metaspace pre-tokenizer; `<s> A </s>` and `<s> A </s></s> B </s>`), "
        "model_max_length 512 with max_position_embeddings 514, so the longest input uses position ids "
        "2…513. Mean pooling, Normalize. Prompts `query: ` / `passage: ` (no default), included in the mean "
        "(include_prompt=true)."
    ),
    "mpnet-st": (
        "MPNet (MPNetModel: relative attention bias, 32 buckets, max_distance 128, shared by all layers; "
        "no token types) in all-mpnet-base-v2's layout: old-format `sentence_bert_config.json` "
        "`{max_seq_length: 384}` under a tokenizer model_max_length of 512 and 514 positions; the "
        "six-key + include_prompt `1_Pooling/config.json` of sentence-transformers 2.3–5.x; WordPiece "
        "tokenizer with `<s>`=0 `<pad>`=1 `</s>`=2 `<unk>`=3 `[UNK]`=4 (the unk token is `[UNK]`), "
        "`<mask>` last, RobertaProcessing post-processor. Mean pooling, Normalize."
    ),
    "distilbert-st": (
        "DistilBERT (DistilBertModel: `dim`/`n_layers`/`n_heads`/`hidden_dim` config keys, no token "
        "types, `transformer.layer.N.attention.{q,k,v,out}_lin`, `sa_layer_norm`, `ffn.lin1`/`lin2`, "
        "`output_layer_norm`, LayerNorm eps fixed at 1e-12) saved by sentence-transformers 6.2 with a "
        "DistilBertTokenizer (uncased WordPiece, no token_type_ids among its inputs), "
        "`model_max_length: 96` of 512 positions. Mean pooling, Normalize; prompts `query` = "
        "`\"query: \"`, `document` = `\"\"`, no default."
    ),
    "modernbert-st": (
        "ModernBERT (ModernBertModel) saved by sentence-transformers 6.2 in transformers 5's config "
        "layout (`layer_types`, `rope_parameters`): pre-norm LayerNorms without bias, no norm before "
        "layer 0's attention, a final norm, fused `Wqkv` without bias, rotary positions with base 500 "
        "in the global layers (0 and 3) and 50 in the local ones (1 and 2, `local_attention: 8`: keys "
        "within ±4 tokens, shorter than most test texts), GeGLU `Wi` (32→2·48) with exact GELU. A "
        "byte-level BPE tokenizer (`[CLS] $A [SEP]`), `model_max_length: 96`. Mean pooling, "
        "Normalize; prompts `query` = `\"query: \"`, `document` = `\"\"`, no default."
    ),
    "gte-st": (
        "GTE (transformers 5's GteModel, `model_type: gte`) saved by sentence-transformers 6.2: "
        "post-norm LayerNorms, q/k/v/o projections with bias, rotary positions (`rope_parameters` "
        "default, θ = 500), a gated feed-forward `act(gate_proj x) · up_proj x` (exact GELU) with "
        "`down_proj` bias, one token type folded into every token. Uncased WordPiece, "
        "`model_max_length: 96` of 512 positions. CLS pooling, Normalize."
    ),
    "gte-hub-st": (
        "The gte-st weights in the layout of the Hub's remote code (Alibaba-NLP/new-impl, "
        "`model_type: new`, `architectures: [NewModel]`, `rope_theta`, `rope_scaling: null`): "
        "`encoder.layer.N.attention.qkv_proj` ([q; k; v]), `attention.o_proj`, `attn_ln`, "
        "`mlp.up_gate_proj` ([up; gate], no bias), `mlp.down_proj`, `mlp_ln`. Its reference is "
        "gte-st's: the same function of the same weights (sentence-transformers would need the "
        "remote code to load it)."
    ),
    "nomic-st": (
        "NomicBERT (transformers 5's NomicBertModel, `model_type: nomic_bert`) saved by "
        "sentence-transformers 6.2: post-norm, no linear biases, full rotary positions "
        "(θ = 1000), SwiGLU `silu(gate_proj x) · up_proj x` (width 256), token type 0 folded "
        "in, LayerNorm eps 1e-5. Mean pooling, Normalize; prompts `search_query: ` and "
        "`search_document: ` (no default)."
    ),
    "nomic-hub-st": (
        "The nomic-st weights in the layout of the Hub's remote code (nomic-ai/nomic-bert-2048, "
        "GPT-2 style keys `n_embd`, `n_layer`, `n_head`, `n_inner`, `n_positions`, "
        "`layer_norm_epsilon`, `rotary_emb_base`, `activation_function: swiglu`, "
        "`rotary_scaling_factor: null`): `emb_ln`, `encoder.layers.N.attn.Wqkv`, `attn.out_proj`, "
        "`mlp.fc11` (up), `mlp.fc12` (gate), `mlp.fc2`, `norm1`, `norm2`. Its reference is "
        "nomic-st's."
    ),
    "nomic-ntk-hub-st": (
        "NomicBERT in the Hub layout with dynamic NTK rope scaling: `rotary_scaling_factor: 2`, "
        "`max_trained_positions: 8`, `n_positions: 512`, max_seq_length 96, so most texts are "
        "longer than the trained length and rotate with base θ·(2·len/8 − 1)^(d/(d−2)) of their "
        "own length. Reference: transformers 5's NomicBertModel with `rope_type: dynamic`, one text "
        "at a time in a fresh model (transformers decides the base per batch and caches it)."
    ),
    "qwen3-st": (
        "Qwen3-Embedding-like: transformers 5's Qwen3Model (`model_type: qwen3`, `architectures: "
        "[Qwen3Model]`), a causal decoder, saved by sentence-transformers 6.2 and then re-saved by "
        "transformers' `save_pretrained(max_shard_size=48KB)` into `model-00001-of-00002.safetensors`, "
        "`model-00002-of-00002.safetensors` and `model.safetensors.index.json` (`weight_map`: every "
        "tensor → its shard; `metadata.total_size`), **bfloat16** (`dtype: bfloat16` in config.json). "
        "Tensors: `embed_tokens.weight` (no lm_head: `tie_word_embeddings: true`), "
        "`layers.N.input_layernorm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight` (no bias, "
        "`attention_bias: false`), `layers.N.self_attn.q_norm.weight` / `k_norm.weight` (width "
        "head_dim), `layers.N.post_attention_layernorm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`, "
        "`norm.weight`. Config: `hidden_size: 32`, `num_hidden_layers: 2`, `num_attention_heads: 4`, "
        "`num_key_value_heads: 2` (GQA: query head h reads KV head h // 2), `head_dim: 16` (q is 64 "
        "wide, not hidden_size), `intermediate_size: 64`, `hidden_act: silu`, `rms_norm_eps: 1e-06`, "
        "`rope_parameters: {rope_type: default, rope_theta: 1000000.0}` (transformers 4.x folders, as "
        "the Hub's Qwen3-Embedding, say `rope_theta` / `rope_scaling: null` at the top level instead; "
        "transformers 5 reads those into rope_parameters), `use_sliding_window: false`, "
        "`sliding_window: null`, `layer_types` all `full_attention`. Semantics (modeling_qwen3.py): "
        "Qwen3RMSNorm is x·rsqrt(mean(x²) + eps)·w (weights here are 1 + 0.2·N(0,1), not ones); q_norm "
        "and k_norm are applied per head to q and k after the projections and before rotary; rotary is "
        "rotate-half over the whole head_dim with inv_freq = θ^(−2i/head_dim); scale head_dim^−½; causal "
        "mask; residual after o_proj and after the SwiGLU MLP down(silu(gate x)·up x); final `norm`. "
        "Tokenizer: a byte-level BPE written by transformers' Qwen2Tokenizer (`tokenizer_class: "
        "Qwen2Tokenizer`): NFC normalizer, Qwen2's regex Split then ByteLevel (no regex of its own), the "
        "256 byte symbols in GPT-2's order (ids 0–255), 300 merges learned from the script's text, then "
        "`<|endoftext|>` = 556, `<|im_start|>` = 557, `<|im_end|>` = 558 (vocab_size 559). As the real "
        "Qwen3-Embedding tokenizer.json, the post-processor is TemplateProcessing `$A <|endoftext|>` "
        "(pair `$A <|endoftext|> $B <|endoftext|>`): every text ends with id 556, also when truncated "
        "(the text loses its tokens, the appended one stays). tokenizer_config.json: `eos_token: "
        "<|im_end|>` (not what is appended), `pad_token: <|endoftext|>`, `bos_token`/`unk_token` null, "
        "`padding_side: left`, `model_max_length: 131072` (as the real file; above the 512 positions, "
        "and sentence-transformers' own save would have capped it at 512). `sentence_bert_config.json` "
        "is the real folder's `{max_seq_length: 64, do_lower_case: false}` (so 64 wins). Pooling "
        "`lasttoken` (`include_prompt: true`): the final norm's output at the last token (the appended "
        "<|endoftext|>); Normalize. Prompts as Qwen3-Embedding-0.6B: `query` = `\"Instruct: Given a web "
        "search query, retrieve relevant passages that answer the query\\nQuery:\"` (a newline inside, "
        "no space after the colon: the text follows directly), `document` = `\"\"`, "
        "`default_prompt_name: null`. Reference: float32 computation from the bf16 values "
        "(`SentenceTransformer(folder, model_kwargs={\"dtype\": torch.float32})`: a plain load keeps "
        "bfloat16 in transformers 5, `dtype=\"auto\"`)."
    ),
    "gemma3-st": (
        "EmbeddingGemma-like: transformers 5's Gemma3TextModel (`model_type: gemma3_text`, "
        "`architectures: [Gemma3TextModel]`) with `use_bidirectional_attention: true`, saved by "
        "sentence-transformers 6.2 in one `model.safetensors`, **bfloat16** (the Dense weights too: "
        "sentence-transformers casts the whole pipeline to the transformer's dtype). Tensors: "
        "`embed_tokens.weight`, `layers.N.input_layernorm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`, "
        "`layers.N.self_attn.q_norm.weight` / `k_norm.weight` (width head_dim), "
        "`layers.N.post_attention_layernorm.weight`, `layers.N.pre_feedforward_layernorm.weight`, "
        "`layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.post_feedforward_layernorm.weight`, "
        "`norm.weight`; `2_Dense/model.safetensors` and `3_Dense/model.safetensors` hold `linear.weight` "
        "only. Config: `hidden_size: 32`, `num_hidden_layers: 4`, `num_attention_heads: 2`, "
        "`num_key_value_heads: 1`, `head_dim: 24` (q is 48 wide), `intermediate_size: 48`, "
        "`hidden_activation: gelu_pytorch_tanh`, `query_pre_attn_scalar: 12` (≠ head_dim), "
        "`rms_norm_eps: 1e-06`, `layer_types: [sliding_attention ×3, full_attention]` (authoritative: the "
        "saved `_sliding_window_pattern: 6` only fills layer_types when it is missing, and would make all "
        "four layers sliding), `rope_parameters: {full_attention: {rope_type: default, rope_theta: "
        "1000000.0}, sliding_attention: {rope_type: default, rope_theta: 10000.0}}` (transformers 4.x "
        "folders, as the Hub's EmbeddingGemma, say `rope_theta` (→ full_attention) and "
        "`rope_local_base_freq` (→ sliding_attention) instead: configuration_gemma3.py "
        "`convert_rope_params_to_dict`), `sliding_window: 10`, `attn_logit_softcapping: null`, "
        "`final_logit_softcapping: null`, `pad_token_id: 0`. Semantics verified in transformers 5.24: "
        "(1) **window** — `Gemma3TextConfig.__post_init__` turns the saved `sliding_window` w into "
        "w // 2 + 1 in memory when use_bidirectional_attention is set (`to_dict` writes (w′ − 1)·2 back, "
        "so an odd saved value does not survive a re-save); `Gemma3TextModel.forward` builds the sliding "
        "mask as `create_sliding_window_causal_mask` (masking_utils.py: kv ≤ q and kv > q − w′) OR "
        "`_bidirectional_window_overlay(w′)` (|q − kv| < w′), which together are |i − j| < w // 2 + 1, "
        "i.e. **|i − j| ≤ w // 2 = 5 here** (EmbeddingGemma's 512: ±256); full layers get the causal "
        "mask OR always-true: every token; padding is ANDed afterwards (sdpa_mask). (2) **scale** "
        "`query_pre_attn_scalar^−½` (Gemma3Attention.scaling), not head_dim. (3) **embeddings** are "
        "multiplied by `Gemma3TextScaledWordEmbedding.embed_scale` = √hidden_size held as a tensor and "
        "cast to the weight dtype at use: float32 √32 = 5.65685415 here (a bf16 computation would use "
        "5.65625). (4) Gemma3RMSNorm is x·rsqrt(mean(x²) + eps)·(1 + w), computed in float32 (weights "
        "0.2·N(0,1) here). (5) per layer: input_layernorm → attention (q_norm/k_norm per head before "
        "rotary; rotate-half; θ by the layer's type; KV head shared by both query heads) → o_proj → "
        "post_attention_layernorm → residual add; pre_feedforward_layernorm → down(gelu_tanh(gate x)·up x) "
        "→ post_feedforward_layernorm → residual add; final `norm`. Positions 0…L−1. Tokenizer: Gemma "
        "3's layout written by transformers' GemmaTokenizer (`tokenizer_class: GemmaTokenizer`): "
        "normalizer Replace(\" \" → \"▁\"), pre-tokenizer Split(\" \", merged_with_previous) (finds "
        "no space after the normalizer), BPE with `byte_fallback: true`, `fuse_unk: true`; `<pad>` = 0, "
        "`<eos>` = 1, `<bos>` = 2, `<unk>` = 3, `<mask>` = 4, `<start_of_turn>` = 5, `<end_of_turn>` = 6, "
        "`<0x00>`…`<0xFF>` = 7…262, then the text's frequent characters and 300 merges (vocab_size 658); "
        "no dummy prefix (a text's first word has no ▁). Characters outside the vocabulary (most "
        "CJK/Hangul, emoji, `—`, some capitals and punctuation) become their UTF-8 bytes. "
        "Post-processor `<bos> $A <eos>`; `padding_side: right`, `model_max_length: 512` (the "
        "tokenizer's 2048 capped at max_position_embeddings by sentence-transformers' save); "
        "`sentence_bert_config.json` `{max_seq_length: 64, do_lower_case: false}` (64 wins). Modules as "
        "EmbeddingGemma-300m: Pooling `mean` → `2_Dense` (32→48, `bias: false`, "
        "`torch.nn.modules.linear.Identity`) → `3_Dense` (48→32, same) → `4_Normalize`; `dense` in the "
        "reference is after 3_Dense. Prompts: EmbeddingGemma's fourteen (`query` = `\"task: search "
        "result | query: \"`, `document` = `\"title: none | text: \"`, `Clustering`, `STS`, … ), "
        "`default_prompt_name: null`; the cases use `query` and `document`. `truncated` holds "
        "`encode(…, truncate_dim=16)` for a few cases: the first 16 components of the normalized "
        "embedding, **not** re-normalized (sentence-transformers cuts after Normalize). Reference: "
        "float32 from the bf16 values, as for qwen3-st."
    ),
    "splade-st": (
        "A SPLADE sparse encoder saved by SparseEncoder 6.2: BertForMaskedLM (the masked-LM head "
        "`cls.predictions.transform` dense + GELU + LayerNorm, then the decoder tied to the word "
        "embeddings, so not in the file, and `cls.predictions.bias`) in a `Transformer` module with "
        "`transformer_task: fill-mask`, then `1_SpladePooling` `{pooling_strategy: max, "
        "activation_function: relu}`: each vocabulary weight is the max over the text's tokens of "
        "log(1 + relu(logit)). Uncased WordPiece, `model_max_length: 96`. Reference rows hold "
        "`indices` and `values`: the non-zero entries of `SparseEncoder.encode`."
    ),
    "splade-distilbert-st": (
        "As splade-st over DistilBertForMaskedLM (`vocab_transform`, `vocab_layer_norm`, "
        "`vocab_projector` tied, its bias saved) with `{pooling_strategy: sum, activation_function: "
        "log1p_relu}`: each weight is the sum over tokens of log(1 + log(1 + relu(logit)))."
    ),
    "bert-cross-encoder": (
        "BertForSequenceClassification, num_labels 1, saved by CrossEncoder 6.2 (`modules.json` with one "
        "Transformer of task `sequence-classification`; `config_sentence_transformers.json` has "
        "`model_type: CrossEncoder` and `activation_fn: torch.nn.modules.activation.Sigmoid`). The real "
        "all-MiniLM-L6-v2 (bert-base-uncased) tokenizer, as ms-marco-MiniLM-L6 has; its tokenizer.json "
        "keeps the file's truncation 128 / padding Fixed(128). `CrossEncoder(max_length=64)` was saved as "
        "`model_max_length: 64`. score = sigmoid(logit)."
    ),
    "xlmr-cross-encoder": (
        "XLMRobertaForSequenceClassification, num_labels 3 (id2label contradiction/entailment/neutral), "
        "saved by CrossEncoder 6.2 with `activation_fn: torch.nn.modules.linear.Identity`: score = the "
        "three raw logits (`softmax` is what predict(apply_softmax=True) gives). Same Unigram tokenizer "
        "as xlmr-st, model_max_length 512 of 514 positions. Head: classifier.dense + tanh on `<s>`, then "
        "classifier.out_proj."
    ),
    "bert-cross-encoder-legacy": (
        "A cross-encoder as sentence-transformers < 4 saved it: a plain transformers folder (no "
        "modules.json, no config_sentence_transformers.json), BertForSequenceClassification num_labels 1, "
        "and config.json `sbert_ce_default_activation_function: torch.nn.modules.linear.Identity` (as "
        "the original cross-encoder/ms-marco-MiniLM-L-6-v2 had): score = the raw logit, not its sigmoid."
    ),
    "bert-cross-encoder-v4": (
        "A cross-encoder as sentence-transformers 4.x/5.x saved it: a plain transformers folder whose "
        "config.json has `sentence_transformers: {activation_fn: torch.nn.modules.linear.Identity, "
        "version: 4.1.0}`; num_labels 1, score = the raw logit."
    ),
    "unsupported-arch": (
        "A valid sentence-transformers folder around a GPT-2 decoder (GPT2Model, byte-level BPE, "
        "last-token pooling). sentence-transformers loads it; replayd must refuse it with an error naming "
        "the architecture (`GPT2Model` / model_type `gpt2`). No reference."
    ),
    "unsupported-module": (
        "Transformer → Pooling → `sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm` "
        "→ Normalize. sentence-transformers applies the LayerNorm module to the pooled vector; replayd must "
        "refuse the folder with an error naming the module type (`LayerNorm`), never skip it. No reference."
    ),
}

README_HEAD = """\
# Test model folders

Small random-weight models in the folder layouts sentence-transformers users have, with the
outputs sentence-transformers computes for them. They are the reference for reading model
folders exactly as sentence-transformers does (max length, tokenizer overrides, pooling,
prompts, Dense, Normalize, cross-encoder activations), for the XLM-R and MPNet encoders, and for
the decoder-style embedding models (Qwen3-Embedding-like `qwen3-st/`, EmbeddingGemma-like
`gemma3-st/`).
The rules behind them are in `docs/notes/sentence-transformers-folders.md`.

Made by `scripts/models/make-test-models.py` (it deletes and rewrites this folder; deterministic:
two runs give byte-identical files) with {versions}. Install those with
`pip install -r scripts/models/requirements-testmodels.txt` (the plain PyPI torch wheel works on
the CPU). The tokenizers are small and made here: the WordPiece vocabularies are built
deterministically from a few KB of multilingual text in the script (the tokenizers
library's WordPieceTrainer and UnigramTrainer break ties through hash maps and give a
different vocabulary on every run), the XLM-R Unigram model is trained by SentencePiece
with XLM-R's `nmt_nfkc` normalisation and laid out as transformers' XLMRobertaConverter
does, and every tokenizer.json is written by transformers' own tokenizer class
(`bert-cross-encoder/` reuses the real all-MiniLM-L6-v2 tokenizer from
`scripts/dev/fetch-model.sh`). Weights are drawn from numpy's PCG64 with fixed seeds, larger than a trained
model's so that attention is far from uniform; the padding rows of word and position
embeddings are zero, as in trained models. `qwen3-st/` and `gemma3-st/` store theirs in
bfloat16, and their references are float32 computations from those stored values. The script also checks every reference row
against `tokenizers.Tokenizer.from_file(tokenizer.json)` (with the overrides the notes
describe) and against an independent float64 numpy forward pass written from the notes.

## Expectations

* **Token ids identical** to `ids` (and `type_ids` where present), including truncation.
* Embeddings (`embedding`, L2-normalised): cosine ≥ 0.9999 per row.
* Un-normalised vectors (`pooled`, `dense`, `token_embeddings`): cosine ≥ 0.9999 **and**
  relative L2 error ‖x − ref‖ / ‖ref‖ ≤ 1e-3.
* Cross-encoder `score` and `logits`: within 1e-4 (absolute).
* `unsupported-arch/` and `unsupported-module/`: loading fails with an error that names
  the refused architecture or module type.

## reference.jsonl

One JSON object a line. Floats are float32 values written with 9 significant digits.

Sentence encoders:

| key | meaning |
|---|---|
| `case` | a name for the case |
| `text` | the input text |
| `prompt_name` | the `prompt_name` passed to `encode`, or `null` for none (then `default_prompt_name`, if the folder has one, applies) |
| `prompt` | the prompt text actually prepended (`null`: none) |
| `ids`, `type_ids` | what sentence-transformers feeds the model (one text, so no padding); `type_ids` only where the tokenizer returns them (BERT) |
| `prompt_length` | tokens of the prompt as sentence-transformers counts them (the prompt tokenized alone, minus a trailing special token); with `include_prompt: false` these leading positions are masked out of pooling |
| `untruncated_length` | token count before truncation, where truncation happened |
| `token_embeddings` | the encoder's last hidden state (one row per token), for the `ordinary-1` case only |
| `pooled` | the Pooling module's output (before Dense/Normalize) |
| `dense` | after the (last) Dense module (before Normalize) |
| `embedding` | `SentenceTransformer(folder, device="cpu").encode(texts, prompt_name=…, convert_to_numpy=True)`, f32 (bf16 folders: loaded with `model_kwargs={{"dtype": torch.float32}}`) |
| `truncated` | `{{"16": […]}}`: `encode(…, truncate_dim=16)`, the first 16 components of `embedding` (not re-normalized); gemma3-st only, a few cases |

Cross-encoders:

| key | meaning |
|---|---|
| `case`, `pair` | a name, and `[query, passage]` |
| `ids`, `type_ids` | as fed to the model (`longest_first` truncation at the folder's maximum) |
| `truncation` | where truncation happened: per side, its token count without special tokens and how many were kept |
| `logits` | the model's raw outputs (one per label) |
| `score` | `CrossEncoder(folder).predict(pairs)`: the folder's activation applied to `logits` (a number for num_labels 1, else a list) |
| `softmax` | `predict(…, apply_softmax=True)` (num_labels > 1 only) |

## Folders
"""


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_readme(versions: dict[str, str], info: dict[str, dict]) -> None:
    vs = ", ".join(f"{k} {v.split('+')[0]}" for k, v in versions.items())
    out = [README_HEAD.format(versions=vs)]
    total = 0
    for name, desc in FOLDERS.items():
        path = OUT / name
        size = folder_size(path)
        total += size
        files = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
        out.append(f"### `{name}/` ({size / 1024:.0f} KiB)\n")
        out.append(desc + "\n")
        meta = info.get(name, {})
        if meta:
            out.append("Resolved: " + ", ".join(f"{k} = {v}" for k, v in meta.items() if k != "cases") + ".\n")
        out.append("Files: " + ", ".join(f"`{f}`" for f in files) + ".\n")
        if "cases" in meta:
            out.append("Cases: " + ", ".join(f"`{c}`" for c in meta["cases"]) + ".\n")
    out.append(f"Total: {total / 1024 / 1024:.1f} MiB.\n")
    (OUT / "README.md").write_text("\n".join(out), encoding="utf-8")


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args()
    versions = check_versions()
    check_mpnet_buckets()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"make-test-models-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        assert uncased_bert_vocab() == uncased_bert_vocab(), "WordPiece training is not deterministic"
        charsmap, uni = train_sentencepiece(1000)
        assert (charsmap, uni) == train_sentencepiece(1000), "SentencePiece training is not deterministic"

        info: dict[str, dict] = {}
        st_specs = [
            ("bert-st-old", build_bert_st_old(tmp), "bert", LONG_EN),
            ("bert-st-new", build_bert_st_new(tmp), "bert", LONG_EN),
            ("xlmr-st", build_xlmr_st(tmp, uni, charsmap), "xlmr", LONG_MULTI),
            ("mpnet-st", build_mpnet_st(tmp), "mpnet", LONG_EN),
            ("distilbert-st", build_distilbert_st(tmp), "bert", LONG_EN),
            ("modernbert-st", build_modernbert_st(tmp), "bert", LONG_EN),
            ("qwen3-st", build_qwen3_st(tmp), "qwen", LONG_EN),
            ("gemma3-st", build_gemma3_st(tmp), "gemma", LONG_MULTI),
        ]
        ce_specs = [
            ("bert-cross-encoder", build_bert_cross_encoder(tmp)),
            ("xlmr-cross-encoder", build_xlmr_cross_encoder(tmp, uni, charsmap)),
            ("bert-cross-encoder-legacy", build_legacy_cross_encoder(
                "bert-cross-encoder-legacy", 8001,
                {"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"})),
            ("bert-cross-encoder-v4", build_legacy_cross_encoder(
                "bert-cross-encoder-v4", 8002,
                {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.1.0"}})),
        ]
        gte, gte_hub = build_rotary(tmp, "gte", 1301)
        nomic, nomic_hub = build_rotary(tmp, "nomic", 1302)
        build_nomic_ntk(tmp, 1303)
        st_specs += [("gte-st", gte, "bert", LONG_EN), ("nomic-st", nomic, "bert", LONG_EN)]
        splade_specs = [
            ("splade-st", build_splade(tmp, "splade-st", "bert", "max", "relu", 1201)),
            ("splade-distilbert-st", build_splade(tmp, "splade-distilbert-st", "distilbert", "sum", "log1p_relu", 1202)),
        ]
        build_unsupported_arch(tmp)
        build_unsupported_module(tmp)

        for name, path, kind, long_base in st_specs:
            rows = st_reference(path, kind, long_base, **ST_REFERENCE_OPTIONS.get(name, {}))
            if kind in ("qwen", "gemma"):
                check_decoder_rows(path, kind, rows)
            write_reference(path, rows)
            if name in ("gte-st", "nomic-st"):
                # The Hub layout computes the same function from the same weights.
                write_reference(OUT / name.replace("-st", "-hub-st"), rows)
            m = load_st(path)
            info[name] = {
                "max length": m.max_seq_length,
                "embedding dimension": m.get_embedding_dimension(),
                "cases": [r["case"] for r in rows],
            }
        for name, path in splade_specs:
            rows = splade_reference(path)
            write_reference(path, rows)
            se = SparseEncoder(str(path), device="cpu")
            info[name] = {
                "max length": se.max_seq_length,
                "vocabulary": se.get_embedding_dimension(),
                "cases": [r["case"] for r in rows],
            }
        for name, path in ce_specs:
            rows = ce_reference(path)
            write_reference(path, rows)
            ce = CrossEncoder(str(path), device="cpu")
            info[name] = {
                "max length": ce.max_seq_length,
                "num_labels": ce.num_labels,
                "activation": type(ce.activation_fn).__name__,
                "cases": [r["case"] for r in rows],
            }
        assert info["bert-cross-encoder"]["activation"] == "Sigmoid"
        assert info["bert-cross-encoder-legacy"]["activation"] == "Identity"
        assert info["bert-cross-encoder-v4"]["activation"] == "Identity"
        assert info["xlmr-cross-encoder"]["activation"] == "Identity"
        # the refused folders are valid: sentence-transformers loads and runs them
        for name in ("unsupported-arch", "unsupported-module"):
            m = SentenceTransformer(str(OUT / name), device="cpu")
            e = m.encode(["a test", ""], convert_to_numpy=True)
            assert e.shape[0] == 2 and np.isfinite(e).all()
        write_readme(versions, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(folder_size(OUT / n) for n in FOLDERS)
    print(f"make-test-models: wrote {len(FOLDERS)} folders to {OUT.relative_to(ROOT)} ({total / 1024 / 1024:.1f} MiB)")


if __name__ == "__main__":
    main()
