"""Daemons that die, restart, hang or drain under connected clients."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import MINILM, MLP, Daemon, cosines, free_port, minilm_toml, mlp_toml, replayd_bin
from replayd import AsyncClient, Client, ConnectionLost, NoHealthyEndpoint, Timeout


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """Both models, on a port chosen up front so a restart comes back on it."""
    d = Daemon(tmp_path_factory.mktemp("fixed"), minilm_toml() + mlp_toml(), port=free_port(), name="fixed")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ds = [
        Daemon(tmp_path_factory.mktemp(f"pair{i}"), mlp_toml(), port=free_port(), name=f"pair{i}")
        for i in range(2)
    ]
    for d in ds:
        d.start()
    yield ds
    for d in ds:
        d.stop()


@pytest.fixture(autouse=True)
def _revive(request):
    """Whatever a test did to its daemons, the next one finds them running."""
    yield
    for name in ("fixed", "pair"):
        if name in request.fixturenames:
            d = request.getfixturevalue(name)
            for one in d if isinstance(d, list) else [d]:
                one.ensure_running()


def wait_until(cond, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def in_background(fn):
    """Runs fn in a thread; returns join(), which gives fn's result or raises
    its exception. (Daemons are started on the main thread only: see
    conftest.Daemon.start.)"""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised by join()
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join(timeout=120):
        t.join(timeout)
        assert not t.is_alive(), "background call hung"
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return join


def freeze_then_kill(d):
    """SIGSTOP, then SIGKILL: the requests it holds are surely lost (an MLP
    daemon answers faster than Python reads, so a plain SIGKILL may find
    nothing outstanding; the plain SIGKILL case is the restart test's)."""
    d.freeze()
    time.sleep(0.02)
    d.kill()


def rows(n, seed):
    return np.random.default_rng(seed).standard_normal((n, 128)).astype(np.float32)


def assert_mlp(got, x, ref):
    want = ref(x)
    errs = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert errs.max() < 1e-5, f"row {int(errs.argmax())} wrong"


def daemon_socket_stats(d):
    """The daemon's own counters of its client socket (`replayctl stats`):
    messages_received, messages_sent (replies handed to libzmq), dropped_sends..."""
    ctl = replayd_bin().with_name("replayctl")
    if not ctl.exists():
        pytest.skip(f"no replayctl beside {replayd_bin()}")
    out = subprocess.run(
        [str(ctl), "--control", d.control, "stats", "--json"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["transport"]["client"]


def short_texts(minilm_set, n):
    texts, ids, want = minilm_set
    pool = [i for i, s in enumerate(ids) if len(s) <= 16]
    pick = [pool[k % len(pool)] for k in range(n)]
    return [texts[i] for i in pick], want[pick]


# ------------------------------------------------------------------ restart


def test_sigkill_and_restart_under_a_connected_client(fixed, minilm_set, mlp_reference):
    with Client(f"tcp://127.0.0.1:{fixed.port}", model=MINILM, timeout=90) as c:
        x = rows(4, 1)
        assert_mlp(c.infer(MLP, x), x, mlp_reference)
        ep = c._core.endpoints[0]
        texts, want = short_texts(minilm_set, 160)
        base = ep.replies
        call = in_background(lambda: c.embed(texts, batch_size=2))  # 80 requests, pipelined
        wait_until(lambda: ep.replies >= base + 3, what="first replies")
        fixed.kill()  # SIGKILL with requests in flight
        time.sleep(0.3)
        fixed.start()  # on the same port
        got = call()
        assert cosines(got, want).min() >= 0.9999  # nothing lost, nothing mixed up
        st = c.stats()[0]
        assert st["disconnects"] >= 1 and st["lost"] >= 1, st
        # later requests just work
        x = rows(9, 2)
        assert_mlp(c.infer(MLP, x), x, mlp_reference)
        assert c.embed(texts[:3]).shape == (3, 384)


def test_in_flight_requests_fail_clearly_without_retries(fixed, mlp_reference):
    with Client(f"tcp://127.0.0.1:{fixed.port}", model=MINILM, timeout=60, max_attempts=1) as c:
        x = rows(8, 3)
        assert_mlp(c.infer(MLP, x), x, mlp_reference)
        ep = c._core.endpoints[0]
        base = ep.sent
        t = time.monotonic()
        call = in_background(lambda: c.embed(["word " * 200] * 64, batch_size=64))  # one slow eager request
        wait_until(lambda: ep.sent > base, what="a request sent")
        fixed.kill()
        with pytest.raises(ConnectionLost) as e:
            call()
        assert time.monotonic() - t < 30
        assert "dropped" in e.value.message and "1 attempts" in e.value.message
        # while it is down, calls give up at their timeout
        t = time.monotonic()
        with pytest.raises(NoHealthyEndpoint):
            c.infer(MLP, x, timeout=0.5)
        assert time.monotonic() - t < 5
        # a call made while it is down succeeds once it is back within its timeout
        call = in_background(lambda: c.infer(MLP, x, timeout=60))
        time.sleep(0.3)
        fixed.start()
        assert_mlp(call(), x, mlp_reference)


def test_async_client_survives_a_restart(fixed, mlp_reference):
    x = rows(3000, 4)  # more than max_in_flight: requests still going out when it dies
    shared = {}
    started = threading.Event()

    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{fixed.port}", timeout=90) as ac:
            assert (await ac.infer(MLP, x[:2])).shape == (2, 10)
            shared["ep"] = ac._core.endpoints[0]
            shared["base"] = shared["ep"].replies
            started.set()
            out = await asyncio.gather(*(ac.infer(MLP, x[i : i + 1]) for i in range(len(x))))
            after = await ac.infer(MLP, x[:5])
            return np.concatenate(out), ac.stats()[0], after

    call = in_background(lambda: asyncio.run(main()))
    assert started.wait(30)
    ep = shared["ep"]
    wait_until(lambda: ep.replies >= shared["base"] + 20, what="first replies")
    freeze_then_kill(fixed)
    time.sleep(0.2)
    fixed.start()
    got, st, after = call()
    assert_mlp(got, x, mlp_reference)
    assert_mlp(after, x[:5], mlp_reference)
    assert st["disconnects"] >= 1 and st["lost"] >= 1, st


# The three tests below force, with a real daemon, the interleavings behind a
# request of test_async_client_survives_a_restart once never being answered
# nor re-sent: the client's event loop (or the sync client, between polls) is
# busy while the connection dies, so the replies and the disconnect event wait
# in their sockets (the reply socket and the monitor's), and requests are sent
# on a connection that is already dead.


def test_async_replies_that_came_before_a_disconnect_settle_their_requests(fixed, mlp_reference):
    """The daemon answers every request, then exits, while the event loop is
    blocked. Whichever the loop then reads first, replies or the disconnect
    event, the replies settle their requests: nothing counts as lost, nothing
    is re-sent (the daemon stays down, so a re-sent request would never be
    answered)."""
    n = 200  # not above max_in_flight: all go out at once
    x = rows(n, 11)

    async def main():
        async with AsyncClient(fixed.endpoint, timeout=10) as ac:
            assert_mlp(await ac.infer(MLP, x[:2]), x[:2], mlp_reference)
            ep = ac._core.endpoints[0]
            base = daemon_socket_stats(fixed)["messages_sent"]
            calls = [asyncio.ensure_future(ac.infer(MLP, x[i : i + 1])) for i in range(n)]
            await asyncio.sleep(0)  # every call sends its request; no reply is read yet
            assert ep.sent == 1 + n and ep.replies == 1, ac.stats()
            # The loop stays blocked from here: the daemon answers everything,
            # and SIGTERM makes it deliver what it has sent, then close.
            wait_until(lambda: daemon_socket_stats(fixed)["messages_sent"] >= base + n, what="every reply")
            fixed.signal(signal.SIGTERM)
            fixed.proc.wait(30)
            time.sleep(0.3)  # the client's libzmq takes the replies, then the disconnect
            got = np.concatenate(await asyncio.gather(*calls))
            return got, ac.stats()[0]

    got, st = asyncio.run(main())
    assert_mlp(got, x, mlp_reference)
    assert st["disconnects"] == 1 and st["lost"] == 0 and st["resent"] == 0, st


def test_async_sends_on_a_dead_connection_do_not_reach_the_next_one(fixed, mlp_reference):
    """Requests sent after the connection died but before the disconnect
    event was read are re-sent by the client once the daemon is back; libzmq
    must not deliver its own copies as well. (With them the restarted daemon
    holds more of the client's requests than max_in_flight, and past its
    send_hwm it drops replies: requests never answered nor re-sent.)"""
    n = 100
    x = rows(n, 12)
    killed = threading.Event()

    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{fixed.port}", timeout=60) as ac:
            assert_mlp(await ac.infer(MLP, x[:2]), x[:2], mlp_reference)
            ep = ac._core.endpoints[0]
            # The loop is blocked: the daemon dies and the client's libzmq sees
            # it, but the disconnect event waits unread on the monitor socket.
            fixed.kill()
            time.sleep(0.3)
            calls = [asyncio.ensure_future(ac.infer(MLP, x[i : i + 1])) for i in range(n)]
            await asyncio.sleep(0)  # the calls run before the loop reads any socket
            assert ep.sent == 1 + n and ep.connected, ac.stats()  # sent on the dead connection
            killed.set()
            got = np.concatenate(await asyncio.gather(*calls))
            return got, ac.stats()[0]

    call = in_background(lambda: asyncio.run(main()))
    assert killed.wait(30)
    fixed.start()
    got, st = call()
    assert_mlp(got, x, mlp_reference)
    assert st["lost"] == n and st["resent"] == n, st
    assert daemon_socket_stats(fixed)["messages_received"] == n  # the re-sends, and only them


def test_sends_on_a_dead_connection_do_not_reach_the_next_one(fixed, mlp_reference):
    """The same for the blocking client, which reads connection events only
    when it polls, after it has sent."""
    n = 100
    x = rows(n, 13)
    with Client(f"tcp://127.0.0.1:{fixed.port}", timeout=60) as c:
        assert_mlp(c.infer(MLP, x[:2]), x[:2], mlp_reference)
        fixed.kill()
        time.sleep(0.3)  # dead, and the client's libzmq knows; the client has not polled since
        call = in_background(lambda: c.infer(MLP, x, batch_size=1))
        ep = c._core.endpoints[0]
        wait_until(lambda: ep.lost == n, what="the requests sent on the dead connection counted lost")
        fixed.start()
        got = call()
        assert_mlp(got, x, mlp_reference)
        st = c.stats()[0]
        assert st["sent"] == 1 + 2 * n and st["resent"] == n, st
    assert daemon_socket_stats(fixed)["messages_received"] == n


# ------------------------------------------------------------ two daemons


def test_two_daemons_kill_one_mid_stream(pair, mlp_reference):
    a, b = pair
    x = rows(6000, 5)
    with Client([a.endpoint, b.endpoint], timeout=90) as c:
        eb = c._core.endpoints[1]
        assert c.wait_connected(10, every=True)

        def kill_b():
            wait_until(lambda: eb.replies >= 300, what="b's first replies")
            freeze_then_kill(b)

        join = in_background(kill_b)
        got = c.infer(MLP, x, batch_size=1)  # 6,000 requests over both
        join()
        assert_mlp(got, x, mlp_reference)
        sa, sb = c.stats()
        assert sb["disconnects"] == 1 and sb["lost"] >= 1, sb
        assert sa["replies"] > sb["replies"]
        # with b gone, everything goes to a
        got = c.infer(MLP, x[:50], batch_size=5)
        assert_mlp(got, x[:50], mlp_reference)
        # b comes back and takes work again
        b.start()
        wait_until(lambda: c.stats()[1]["connected"], what="b reconnected")
        before = c.stats()[1]["replies"]
        c.infer(MLP, x[:400], batch_size=1)
        assert c.stats()[1]["replies"] > before


def test_async_two_daemons_kill_one_mid_stream(pair, mlp_reference):
    a, b = pair
    x = rows(20000, 6)

    async def main():
        async with AsyncClient([a.endpoint, b.endpoint], timeout=90) as ac:
            assert await ac.wait_connected(10, every=True)
            ea = ac._core.endpoints[0]

            async def kill_a():
                while ea.replies < 200:
                    await asyncio.sleep(0.001)
                await asyncio.get_running_loop().run_in_executor(None, freeze_then_kill, a)

            parts = await asyncio.gather(
                kill_a(), *(ac.infer(MLP, x[i : i + 500], batch_size=2) for i in range(0, 20000, 500))
            )
            for _ in range(500):  # the monitor's word may come after the last reply
                if not ea.connected:
                    break
                await asyncio.sleep(0.01)
            return np.concatenate(parts[1:]), ac.stats()

    got, st = asyncio.run(main())
    assert_mlp(got, x, mlp_reference)
    assert st[0]["disconnects"] == 1 and st[0]["lost"] >= 1, st


def test_a_hung_daemon_is_bypassed(pair, mlp_reference):
    """SIGSTOP: the connection stays up but nothing comes back. After the
    liveness timeout its requests are sent to the other daemon."""
    a, b = pair
    x = rows(3000, 7)
    with Client([a.endpoint, b.endpoint], timeout=60, liveness_timeout=0.5) as c:
        assert c.wait_connected(10, every=True)
        eb = c._core.endpoints[1]

        def stop_b():
            wait_until(lambda: eb.replies >= 200, what="b's first replies")
            b.freeze()

        join = in_background(stop_b)
        t = time.monotonic()
        got = c.infer(MLP, x, batch_size=1)
        took = time.monotonic() - t
        join()
        assert_mlp(got, x, mlp_reference)
        assert took < 20, took
        assert c.stats()[1]["suspect"]
        b.thaw()
        # its late replies clear the suspicion and are otherwise ignored
        wait_until(lambda: not c.stats()[1]["suspect"], what="b answering again")
        assert_mlp(c.infer(MLP, x[:100], batch_size=1), x[:100], mlp_reference)


def test_a_hung_single_daemon_times_out(fixed):
    with Client(f"tcp://127.0.0.1:{fixed.port}", timeout=30, liveness_timeout=0.2) as c:
        assert c.infer(MLP, rows(1, 8)).shape == (1, 10)
        fixed.freeze()
        try:
            t = time.monotonic()
            with pytest.raises(Timeout) as e:
                c.infer(MLP, rows(3, 8), timeout=1.0)
            assert 0.9 < time.monotonic() - t < 5
            assert "no reply within 1 s" in e.value.message
        finally:
            fixed.thaw()
        assert c.infer(MLP, rows(2, 9)).shape == (2, 10)


def test_sigterm_one_of_two_mid_stream(pair, mlp_reference):
    """A draining daemon answers "unavailable" (or closes): nothing is lost."""
    a, b = pair
    x = rows(4000, 10)
    with Client([a.endpoint, b.endpoint], timeout=90) as c:
        assert c.wait_connected(10, every=True)
        ea = c._core.endpoints[0]

        def term_a():
            wait_until(lambda: ea.replies >= 300, what="a's first replies")
            a.signal(signal.SIGTERM)

        join = in_background(term_a)
        got = c.infer(MLP, x, batch_size=1)
        join()
        assert_mlp(got, x, mlp_reference)
        a.proc.wait(30)
        wait_until(lambda: not c.stats()[0]["connected"], what="a's disconnection")
        sa, sb = c.stats()
        assert sa["disconnects"] == 1, sa
        # what a could not take went to b
        assert sb["resent"] == sa["lost"] + sa["unavailable"], (sa, sb)
