"""infer on the seed MLP, and many requests in flight on one socket."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import MLP, rel_err
from replayd import AsyncClient, Client


@pytest.fixture(scope="module")
def client(endpoint):
    with Client(endpoint, timeout=60) as c:
        yield c


def test_infer_matches_the_float64_reference(client, mlp_io):
    for x, y in mlp_io:
        got = client.infer(MLP, x)
        assert got.shape == y.shape and got.dtype == np.float32
        assert rel_err(got, y) < 1e-5, f"batch of {len(x)}"
    # one 1-D row gives one 1-D row
    x, y = mlp_io[0]
    assert rel_err(client.infer(MLP, x[0]), y[0]) < 1e-5
    # float64 and list input are converted
    x, y = mlp_io[2]
    assert rel_err(client.infer(MLP, x.astype(np.float64).tolist()), y) < 1e-5


def test_f16_output(client, mlp_io):
    x, y = mlp_io[3]
    got = client.infer(MLP, x, output_dtype="f16")
    assert got.dtype == np.float16
    assert rel_err(got, y) < 2e-3


def test_a_thousand_requests_in_flight_on_one_socket(client, mlp_reference):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1000, 128)).astype(np.float32)
    before = client.stats()[0]
    got = client.infer(MLP, x, batch_size=1)  # 1,000 requests, pipelined max_in_flight at a time
    after = client.stats()[0]
    assert after["sent"] - before["sent"] == 1000
    # max_in_flight (not 1,000: half the daemon's send_hwm at most, see the
    # README) sent before the first reply is read
    assert after["peak_in_flight"] == client._core.max_in_flight, after
    want = mlp_reference(x)
    assert got.shape == (1000, 10)
    errs = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert errs.max() < 1e-5, f"row {int(errs.argmax())} got another row's answer?"
    # uneven chunks, in order
    got = client.infer(MLP, x, batch_size=7)
    assert rel_err(got, want) < 1e-5


def test_async_thousand_concurrent_calls(endpoint, mlp_reference):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1000, 128)).astype(np.float32)
    want = mlp_reference(x)

    async def main():
        async with AsyncClient(endpoint, timeout=60) as ac:
            rows = await asyncio.gather(*(ac.infer(MLP, x[i : i + 1]) for i in range(1000)))
            peak = ac.stats()[0]["peak_in_flight"]
            many = await ac.infer(MLP, x, batch_size=3)
            return np.concatenate(rows), peak, many, ac._core.max_in_flight

    got, peak, many, window = asyncio.run(main())
    assert peak >= 0.9 * window  # (the daemon may answer a few while calls still send)
    errs = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert errs.max() < 1e-5, f"row {int(errs.argmax())} mismatched"
    assert rel_err(many, want) < 1e-5


def test_async_encode_and_embed(endpoint, minilm_set):
    from conftest import MINILM, cosines

    texts, ids, want = minilm_set
    sel = list(range(60, 90))

    async def main():
        async with AsyncClient(endpoint, model=MINILM, timeout=120) as ac:
            parts = await asyncio.gather(
                ac.encode([texts[i] for i in sel], batch_size=4),
                ac.embed([texts[i] for i in sel[:5]]),
                ac.embed_ids([ids[i] for i in sel[:5]]),
                ac.encode(texts[sel[0]]),
            )
            return parts

    a, b, c, d = asyncio.run(main())
    assert cosines(a, want[sel]).min() >= 0.9999
    assert cosines(b, want[sel[:5]]).min() >= 0.9999
    assert cosines(c, want[sel[:5]]).min() >= 0.9999
    assert d.shape == (384,) and cosines(d, want[sel[0]]) >= 0.9999


def test_async_client_outlives_its_event_loop_and_cancellation(endpoint, mlp_io):
    x, y = mlp_io[2]
    ac = AsyncClient(endpoint, timeout=60)

    async def once():
        return await ac.infer(MLP, x)

    async def cancelled():
        # a call cancelled while in flight is abandoned; the client goes on
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ac.infer(MLP, np.tile(x, (200, 1)), batch_size=1), 0.0001)
        return await ac.infer(MLP, x)

    try:
        assert rel_err(asyncio.run(once()), y) < 1e-5
        # a second asyncio.run: new loop, new sockets
        assert rel_err(asyncio.run(once()), y) < 1e-5
        assert rel_err(asyncio.run(cancelled()), y) < 1e-5
    finally:
        ac.close()
