"""encode/embed against sentence-transformers' own embeddings
(tests/data/minilm_set_a.jsonl, fp32, CPU): cosine >= 0.9999 per text."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DIM, MINILM, cosines
from replayd import Client

COS = 0.9999


@pytest.fixture(scope="module")
def client(endpoint):
    with Client(endpoint, model=MINILM, timeout=180) as c:
        yield c


def check(got, want, what):
    got = np.asarray(got)
    assert got.dtype == np.float32, what
    assert got.shape == want.shape, what
    cos = cosines(got, want)
    assert cos.min() >= COS, f"{what}: worst cosine {cos.min()} at {int(cos.argmin())}"


def test_encode_the_whole_set_like_sentence_transformers(client, minilm_set):
    texts, _, want = minilm_set
    got = client.encode(texts)
    check(got, want, "encode(300 texts)")
    # already normalised, as the model folder says
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_a_single_string_gives_a_vector(client, minilm_set):
    texts, _, want = minilm_set
    for i in (0, 1, 5, len(texts) - 1):  # the empty text, whitespace, ...
        v = client.encode(texts[i])
        assert v.shape == (DIM,), repr(texts[i][:40])
        check(v[None], want[i : i + 1], f"encode({texts[i][:30]!r})")
    # embed stays 2-D
    assert client.embed(texts[3]).shape == (1, DIM)


def short_indices(ids, max_tokens):
    return [i for i, s in enumerate(ids) if len(s) <= max_tokens]


@pytest.mark.parametrize(
    "n, batch_size",
    [
        (1, 32),  # a list of one
        (7, 1),  # below every batch bucket: 7 requests of one
        (7, 3),  # uneven chunks
        (64, 64),  # above the largest batch bucket (32): one eager request
        (1000, 32),  # 32 requests in flight
        (200, 1000),  # one request of 200 (run eagerly by the daemon); still ordered
    ],
)
def test_encode_lists_in_any_batch_size(client, minilm_set, n, batch_size):
    texts, ids, want = minilm_set
    if n >= 64:
        # Short texts (<= 16 tokens) keep the 2-core CPU busy for seconds, not minutes.
        pool = short_indices(ids, 16)
    else:
        pool = list(range(len(texts)))
    rng = np.random.default_rng(n * 1000 + batch_size)
    pick = rng.choice(pool, size=n, replace=n > len(pool))
    got = client.encode([texts[i] for i in pick], batch_size=batch_size)
    check(got, want[pick], f"encode({n} texts, batch_size={batch_size})")


def test_embed_matches_encode_and_embed_ids(client, minilm_set):
    texts, ids, want = minilm_set
    sel = list(range(10, 30))
    a = client.embed([texts[i] for i in sel])
    b = client.embed_ids([ids[i] for i in sel])
    c = client.embed_ids([np.asarray(ids[i], dtype=np.int64) for i in sel], batch_size=4)
    check(a, want[sel], "embed")
    check(b, want[sel], "embed_ids")
    check(c, want[sel], "embed_ids(numpy)")


def test_normalize_and_truncate_dim(client, minilm_set):
    texts, _, want = minilm_set
    sel = list(range(20, 30))
    got = client.encode([texts[i] for i in sel], normalize_embeddings=True, truncate_dim=64)
    assert got.shape == (10, 64)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ref = want[sel, :64]
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    assert cosines(got, ref).min() >= COS


def test_the_daemon_truncates_to_dimensions(client, minilm_set):
    texts, _, want = minilm_set
    sel = list(range(30, 40))
    # MiniLM normalises, so the daemon normalises the cut vector again.
    got = client.embed([texts[i] for i in sel], dimensions=32)
    assert got.shape == (10, 32)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ref = want[sel, :32]
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    assert cosines(got, ref).min() >= COS
    ids = client.embed_ids([[101, 7592, 2088, 102]], dimensions=DIM)
    assert ids.shape == (1, DIM)


def test_f16_output(client, minilm_set):
    texts, _, want = minilm_set
    got = client.embed(texts[40:50], output_dtype="f16")
    assert got.dtype == np.float16 and got.shape == (10, DIM)
    assert cosines(got.astype(np.float32), want[40:50]).min() >= 0.999


def test_prompts(endpoint, minilm_set):
    texts, _, _ = minilm_set
    with Client(endpoint, model=MINILM, prompts={"query": "query: "}, timeout=60) as c:
        a = c.encode(texts[50:53], prompt_name="query")
        b = c.embed(["query: " + t for t in texts[50:53]])
        c2 = c.encode(texts[50:53], prompt="query: ")
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(c2, b, atol=1e-6)
        with pytest.raises(ValueError, match="not found"):
            c.encode(["x"], prompt_name="passage")


def test_torch_outputs_need_torch(client):
    try:
        import torch
    except ImportError:
        with pytest.raises(ImportError, match="torch"):
            client.encode(["x"], convert_to_tensor=True)
        with pytest.raises(ImportError, match="torch"):
            client.encode(["x"], convert_to_numpy=False)
        return
    t = client.encode(["x", "y"], convert_to_tensor=True)
    assert isinstance(t, torch.Tensor) and tuple(t.shape) == (2, DIM)
    assert tuple(client.encode("x", convert_to_tensor=True).shape) == (DIM,)
    rows = client.encode(["x", "y"], convert_to_numpy=False)
    assert len(rows) == 2 and isinstance(rows[0], torch.Tensor)


def test_encode_rejects_what_it_cannot_do(client):
    with pytest.raises(ValueError, match="token_embeddings"):
        client.encode(["x"], output_value="token_embeddings")
    with pytest.raises(ValueError, match="precision"):
        client.encode(["x"], precision="int8")
    with pytest.raises(TypeError, match="unexpected keyword"):
        client.encode(["x"], convert_to_nupy=True)
    with pytest.raises(TypeError, match="batch_size"):
        client.encode(["x"], 64)  # sentence-transformers 2's positional batch_size
    with pytest.raises(TypeError, match="strings"):
        client.embed(["x", 3])
    # accepted and ignored, as sentence-transformers' multi-process knobs
    assert client.encode(["x"], pool=None, chunk_size=None).shape == (1, DIM)


def test_empty_input(client):
    assert client.embed([]).shape[0] == 0
    assert client.encode([]).shape[0] == 0
