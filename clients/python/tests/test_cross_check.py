"""One running daemon, every kind of client: the Python client, the Rust
client (examples/embed_file.rs, built by `cargo test --all-targets`), raw
pyzmq REQ and DEALER sockets written from docs/protocol.md, and the HTTP
front's /v1/embeddings and /embed all get the same embeddings for the same
texts."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from conftest import DIM, MINILM, REPO, Daemon, cosines, minilm_toml, replayd_bin
from replayd import Client

TEXTS = [
    "replay the graph",
    "pad to the bucket",
    "A man is eating food.",
    "héllo wörld, ünïcode",
    "",
    "a longer sentence, with punctuation; and several clauses that make it longer than sixteen tokens",
    "x",
]


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory):
    d = Daemon(
        tmp_path_factory.mktemp("cross"),
        minilm_toml(),
        server='\n[http]\nenabled = true\nlisten = "127.0.0.1:0"\n',
        name="cross",
    )
    d.start()
    d.http = json.loads(d.ready_file.read_text())["http"]
    yield d
    d.stop()


def post(addr: str, path: str, body: dict):
    req = urllib.request.Request(
        f"http://{addr}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.load(r)


def rust_example() -> Path:
    for base in (Path(replayd_bin()).parent, REPO / "target" / "debug", REPO / "target" / "release"):
        p = base / "examples" / "embed_file"
        if p.exists():
            return p
    pytest.skip("examples/embed_file is not built (cargo test --all-targets builds it)")


def same(name: str, got, want) -> None:
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape, name
    assert cosines(got, want).min() >= 0.999999, name
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)


def test_every_client_gets_the_same_embeddings(http_daemon, tmp_path):
    endpoint = http_daemon.endpoint
    with Client(endpoint, model=MINILM) as c:
        want = c.embed(TEXTS, batch_size=3)
    assert want.shape == (len(TEXTS), DIM)

    ctx = zmq.Context()
    try:
        # A REQ socket: one request, the delimiter handled by the socket.
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 120_000)
        s.connect(endpoint)
        s.send_multipart([msgpack.packb({"v": 1, "id": 1, "model": MINILM, "input": "texts"})] + [t.encode() for t in TEXTS])
        head, *data = s.recv_multipart()
        head = msgpack.unpackb(head)
        assert head["status"] == "ok", head
        same("pyzmq REQ", np.frombuffer(data[0], "<f4").reshape(head["shape"]), want)
        s.close()

        # A DEALER socket: one request per text, all outstanding, matched by id.
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 120_000)
        s.connect(endpoint)
        for i, t in enumerate(TEXTS):
            s.send_multipart([msgpack.packb({"v": 1, "id": 100 + i, "model": MINILM, "input": "texts"}), t.encode()])
        rows = {}
        for _ in TEXTS:
            head, *data = s.recv_multipart()
            head = msgpack.unpackb(head)
            assert head["status"] == "ok", head
            rows[head["id"] - 100] = np.frombuffer(data[0], "<f4")
        same("pyzmq DEALER", [rows[i] for i in range(len(TEXTS))], want)
        s.close()
    finally:
        ctx.term()

    # The HTTP front: OpenAI's shape (float and base64) and TEI's.
    addr = http_daemon.http
    r = post(addr, "/v1/embeddings", {"input": TEXTS, "model": MINILM})
    assert [d["index"] for d in r["data"]] == list(range(len(TEXTS)))
    same("HTTP /v1/embeddings", [d["embedding"] for d in r["data"]], want)
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 2 * len(TEXTS)
    r = post(addr, "/v1/embeddings", {"input": TEXTS, "model": MINILM, "encoding_format": "base64"})
    b64 = [struct.unpack(f"<{DIM}f", base64.b64decode(d["embedding"])) for d in r["data"]]
    same("HTTP /v1/embeddings base64", b64, want)
    same("HTTP /embed", post(addr, "/embed", {"inputs": TEXTS}), want)

    # The Rust client, through the example program (several requests in flight).
    corpus = tmp_path / "texts.txt"
    # embed_file skips empty lines: compare the non-empty texts.
    keep = [i for i, t in enumerate(TEXTS) if t.strip()]
    corpus.write_text("\n".join(TEXTS[i] for i in keep) + "\n", encoding="utf-8")
    out = subprocess.run(
        [str(rust_example()), str(corpus), "-e", endpoint, "-m", MINILM, "--batch", "2", "--concurrency", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr
    rust = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    same("Rust client", rust, want[keep])
