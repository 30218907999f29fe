"""Clients written from docs/protocol.md alone (raw pyzmq REQ and DEALER
sockets, msgpack) get what the replayd client gets."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from conftest import DIM, MINILM, MLP, cosines, rel_err
from replayd import Client

SEL = [0, 2, 7, 11, 19, 23, 42, 77, 150, 299]


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def tensor(head, frames):
    assert head["status"] == "ok", head
    dt = {"f32": "<f4", "f16": "<f2"}[head["dtype"]]
    return np.frombuffer(frames[0], dtype=dt).reshape(head["shape"])


def test_req_socket(ctx, endpoint, minilm_set, mlp_io, mlp_reference):
    texts, _, want = minilm_set
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 60_000)
    s.connect(endpoint)
    try:
        s.send_multipart(
            [msgpack.packb({"v": 1, "id": 1, "model": MINILM, "input": "texts"})]
            + [texts[i].encode("utf-8") for i in SEL]
        )
        head, *data = s.recv_multipart()
        head = msgpack.unpackb(head)
        assert head["id"] == 1 and head["shape"] == [len(SEL), DIM]
        raw = tensor(head, data)
        assert cosines(raw, want[SEL]).min() >= 0.9999

        x, y = mlp_io[1]
        s.send_multipart(
            [
                msgpack.packb(
                    {"v": 1, "id": 2, "model": MLP, "input": "tensor", "dtype": "f32", "shape": list(x.shape)}
                ),
                x.astype("<f4").tobytes(),
            ]
        )
        head, *data = s.recv_multipart()
        head = msgpack.unpackb(head)
        assert head["id"] == 2
        assert rel_err(tensor(head, data), y) < 1e-5
    finally:
        s.close()

    with Client(endpoint, model=MINILM) as c:
        mine = c.embed([texts[i] for i in SEL])
    assert cosines(mine, raw).min() >= 0.999999
    np.testing.assert_allclose(mine, raw, atol=1e-5)


def test_dealer_socket_pipelined(ctx, endpoint, minilm_set):
    texts, _, want = minilm_set
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        # One request per text, all outstanding at once; ids chosen freely.
        for k, i in enumerate(SEL):
            head = {"v": 1, "id": 1000 + k, "model": MINILM, "input": "texts"}
            s.send_multipart([msgpack.packb(head), texts[i].encode("utf-8")])
        # ... plus one bad request: it gets its own error reply.
        s.send_multipart([msgpack.packb({"v": 1, "id": 7, "model": MINILM, "input": "texts", "timeout_ms": 5}), b"x"])
        got = {}
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        while len(got) < len(SEL) + 1:
            assert poller.poll(60_000), f"only {len(got)} replies"
            head, *data = s.recv_multipart()
            head = msgpack.unpackb(head)
            got[head["id"]] = (head, data)
        err = got.pop(7)[0]
        assert err["status"] == "error" and err["code"] == "bad_request" and "timeout_ms" in err["message"]
        raw = np.stack([tensor(*got[1000 + k])[0] for k in range(len(SEL))])
    finally:
        s.close()
    assert cosines(raw, want[SEL]).min() >= 0.9999
    with Client(endpoint, model=MINILM) as c:
        mine = c.embed([texts[i] for i in SEL])
    np.testing.assert_allclose(mine, raw, atol=1e-5)
