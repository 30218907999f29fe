"""Sparse encoders (SPLADE) through the Python clients: the daemon serving
tests/data/models/splade-st on the CPU backend, every reference row's
non-zero weights against sentence-transformers' (the same indices wherever
a weight exceeds 1e-3 of the row's largest, values within 1e-3 relative),
top_k, f16 values, and the errors."""

import asyncio
import json

import numpy as np
import pytest

from conftest import REPO, Daemon
from replayd import AsyncClient, BadRequest, Client, SparseEmbeddings

FOLDER = REPO / "tests" / "data" / "models" / "splade-st"


@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    d = Daemon(
        tmp_path_factory.mktemp("splade"),
        f"""
[[models]]
name = "splade"
kind = "bert"
path = "{FOLDER}"
batching = "packed"
token_budgets = [64, 256]
max_seqs_per_batch = 16
""",
        name="splade",
    )
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference():
    with open(FOLDER / "reference.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check(indices, values, row):
    want = np.zeros(max(int(np.max(row["indices"])), int(np.max(indices, initial=0))) + 1)
    want[row["indices"]] = row["values"]
    got = np.zeros_like(want)
    got[np.asarray(indices, np.int64)] = values
    big = 1e-3 * want.max()
    assert set(np.nonzero(got > big)[0]) == set(np.nonzero(want > big)[0]), row["case"]
    sel = want > big
    rel = np.abs(got[sel] - want[sel]) / want[sel]
    assert rel.max() <= 1e-3, (row["case"], rel.max())


def test_sparse_rows_match_sentence_transformers(splade, reference):
    texts = [r["text"] for r in reference]
    with Client(splade.endpoint, model="splade", timeout=120) as c:
        got = c.embed_sparse(texts, batch_size=8)
        assert isinstance(got, SparseEmbeddings) and got.shape == (len(texts), 1432)
        for (idx, val), row in zip(got, reference):
            assert np.all(np.diff(idx.astype(np.int64)) > 0), "indices ascending"
            check(idx, val, row)
        dense = got.to_dense()
        assert dense.shape == (len(texts), 1432)
        top = c.embed_sparse(texts[0], top_k=4)
        idx, val = top.row(0)
        order = np.argsort(-np.asarray(reference[0]["values"]), kind="stable")[:4]
        assert sorted(idx.tolist()) == sorted(np.asarray(reference[0]["indices"])[order].tolist())
        half = c.embed_sparse(texts[:3], output_dtype="f16")
        assert half.values.dtype == np.float16
        for (idx, val), row in zip(half, reference[:3]):
            assert idx.tolist() == row["indices"]
        with pytest.raises(ValueError, match="embed_sparse"):
            c.embed(texts[:2])
        with pytest.raises(ValueError, match="top_k"):
            c.embed_sparse(texts[:1], top_k=0)


def test_async_client_too(splade, reference):
    async def run():
        async with AsyncClient(splade.endpoint, model="splade", timeout=120) as c:
            return await c.embed_sparse([r["text"] for r in reference[:5]])

    got = asyncio.run(run())
    for (idx, val), row in zip(got, reference[:5]):
        check(idx, val, row)


def test_dense_models_refuse_top_k(endpoint):
    from conftest import MINILM

    with Client(endpoint, model=MINILM, timeout=60) as c:
        with pytest.raises(BadRequest, match="top_k"):
            c.embed_sparse(["a text"], top_k=3)
