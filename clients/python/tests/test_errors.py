"""Every error code a client can provoke maps to its exception."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import DIM, MINILM, MLP, Daemon, free_port, mlp_toml
import replayd
from replayd import (
    BadRequest,
    Client,
    ConnectionLost,
    DeadlineExceeded,
    NoHealthyEndpoint,
    Overloaded,
    ReplaydError,
    TooLong,
    UnknownModel,
)
from replayd.errors import error_from_reply


@pytest.fixture(scope="module")
def client(endpoint):
    with Client(endpoint, model=MINILM, timeout=60) as c:
        yield c


def test_unknown_model(client):
    with pytest.raises(UnknownModel) as e:
        client.embed(["x"], model="no-such-model")
    assert e.value.code == "unknown_model" and isinstance(e.value.id, int)
    assert MINILM in e.value.message and MLP in e.value.message  # lists the served ones
    with pytest.raises(UnknownModel):
        client.infer("no-such-mlp", np.zeros((1, 128)))


@pytest.mark.parametrize(
    "what, call",
    [
        ("wrong feature count", lambda c: c.infer(MLP, np.zeros((2, 127)))),
        ("3-D tensor", lambda c: c.infer(MLP, np.zeros((2, 2, 128)))),
        ("texts to an MLP", lambda c: c.embed(["x"], model=MLP)),
        ("a tensor to an encoder", lambda c: c.infer(MINILM, np.zeros((1, 128)))),
        ("id outside the vocabulary", lambda c: c.embed_ids([[101, 999_999, 102]])),
        ("empty id sequence", lambda c: c.embed_ids([[]])),
        ("invalid UTF-8", lambda c: c.embed(["ok", "\ud800"])),
        ("dimensions wider than the model", lambda c: c.embed(["x"], dimensions=10_000)),
    ],
)
def test_bad_request(client, what, call):
    with pytest.raises(BadRequest) as e:
        call(client)
    assert e.value.code == "bad_request" and e.value.message, what


def test_too_long_without_truncation(client):
    texts = ["short", "also short", "word " * 600, "fine"]
    with pytest.raises(TooLong) as e:
        client.embed(texts, truncate=False, batch_size=1)
    assert e.value.indices == [2]  # the caller's position of the offending text
    assert "256" in e.value.message
    # truncation (the default) embeds it
    assert client.embed(texts).shape == (4, 384)
    with pytest.raises(TooLong):
        client.embed_ids([[101] + [2000] * 300 + [102]])


def test_deadline_in_the_past(client):
    with pytest.raises(DeadlineExceeded) as e:
        client.embed(["x"], deadline=time.time() - 1)
    assert e.value.code == "deadline_exceeded"
    with pytest.raises(DeadlineExceeded):
        client.infer(MLP, np.zeros((1, 128)), deadline=time.time() - 0.001)
    # a future deadline is fine
    assert client.embed(["x"], deadline=time.time() + 30).shape == (1, 384)


def test_failing_request_fails_the_call_and_leaves_the_client_usable(client):
    texts = ["a"] * 40 + ["word " * 600] + ["b"] * 40
    with pytest.raises(TooLong) as e:
        client.embed(texts, truncate=False, batch_size=8)
    assert 40 in e.value.indices
    # late replies of that call's other requests are dropped; the next call is fine
    out = client.embed(["a", "b"])
    assert out.shape == (2, 384)
    assert client.stats()[0]["in_flight"] == 0  # abandoned, not counted


def test_local_argument_errors(client):
    with pytest.raises(ValueError):
        client.embed(["x"], priority=256)
    with pytest.raises(ValueError):
        client.embed(["x"], output_dtype="f64")
    with pytest.raises(TypeError):
        Client("tcp://127.0.0.1:1").embed(["x"])  # no model anywhere
    with pytest.raises(ValueError):
        Client("127.0.0.1:5555")


def test_unknown_codes_map_to_the_base_class():
    e = error_from_reply({"v": 1, "id": 9, "status": "error", "code": "quota_exceeded", "message": "m"})
    assert type(e) is ReplaydError and e.code == "quota_exceeded" and e.id == 9
    for code, cls in [
        ("bad_request", replayd.BadRequest),
        ("unknown_model", replayd.UnknownModel),
        ("too_long", replayd.TooLong),
        ("overloaded", replayd.Overloaded),
        ("deadline_exceeded", replayd.DeadlineExceeded),
        ("unavailable", replayd.Unavailable),
        ("internal", replayd.Internal),
    ]:
        e = error_from_reply({"v": 1, "id": 1, "status": "error", "code": code, "message": "m"})
        assert type(e) is cls and isinstance(e, ReplaydError) and e.code == code


def test_no_daemon_at_all_fails_within_the_timeout():
    port = free_port()
    with Client(f"tcp://127.0.0.1:{port}", model=MINILM) as c:
        t = time.monotonic()
        with pytest.raises(NoHealthyEndpoint) as e:
            c.embed(["x"], timeout=0.5)
        took = time.monotonic() - t
    assert 0.4 < took < 3, took
    assert isinstance(e.value, ConnectionLost) and str(port) in e.value.message


@pytest.fixture(scope="module")
def tiny_queue(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tinyq"), mlp_toml(), batching="max_queue = 2\nmax_wait_us = 2000", name="tinyq")
    d.start()
    yield d
    d.stop()


def test_overloaded(tiny_queue, mlp_reference):
    x = np.random.default_rng(3).standard_normal((400, 128)).astype(np.float32)
    # No retries: the first "overloaded" reply surfaces.
    with Client(tiny_queue.endpoint, timeout=30, max_attempts=1) as c:
        with pytest.raises(Overloaded) as e:
            c.infer(MLP, x, batch_size=1)
        assert e.value.code == "overloaded"
    # With retries (back-off, jittered) every row gets through, in order.
    with Client(tiny_queue.endpoint, timeout=60, max_attempts=1000, overload_backoff=0.002,
                overload_backoff_max=0.05) as c:
        got = c.infer(MLP, x, batch_size=1)
    want = mlp_reference(x)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_a_text_over_max_request_bytes_fails_before_sending(endpoint):
    # The daemon would close the connection without a reply: the client says
    # so at once instead of waiting out its timeout.
    with Client(endpoint, model=MINILM, timeout=60, max_request_bytes=64 << 10) as c:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="max_request_bytes"):
            c.embed(["short", "x" * (100 << 10)])
        with pytest.raises(ValueError, match="max_request_bytes"):
            c.infer(MLP, np.zeros((2, 20_000), dtype=np.float32))
        assert time.monotonic() - t0 < 1.0
        assert c.embed(["short"]).shape == (1, DIM)  # and the client still works
