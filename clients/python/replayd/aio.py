"""The asyncio client (zmq.asyncio)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import zmq
import zmq.asyncio

from . import _sockets
from ._protocol import SparseEmbeddings
from ._api import _ClientBase, _Prepared
from ._core import Call, Endpoint
from .errors import ConnectionLost

__all__ = ["AsyncClient"]

log = logging.getLogger("replayd")


class AsyncClient(_ClientBase):
    """The asyncio twin of :class:`Client`: the same constructor and methods,
    as coroutines. Any number of calls may run concurrently (e.g. under
    ``asyncio.gather``); they share one DEALER socket per endpoint, and their
    requests are pipelined and matched by id.

    The client binds to the event loop of its first call; once that loop has
    ended, a later loop gets new sockets. Close it with ``await
    client.aclose()`` or ``async with``.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        model: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        *,
        context: Optional[zmq.asyncio.Context] = None,
        **options: Any,
    ) -> None:
        super().__init__(endpoints, model, timeout, **options)
        self._ctx = context
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tasks: List[asyncio.Task] = []
        self._socks: Dict[Endpoint, Any] = {}
        self._mons: Dict[Endpoint, Any] = {}
        self._readers: Dict[Endpoint, asyncio.Task] = {}
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_at: Optional[float] = None
        self._closed = False

    # ------------------------------------------------------------- the API

    async def embed(
        self,
        texts: Union[str, Sequence[str]],
        model: Optional[str] = None,
        *,
        batch_size: Optional[int] = 32,
        timeout: Optional[float] = None,
        priority: int = 0,
        deadline: Optional[float] = None,
        truncate: bool = True,
        output_dtype: str = "f32",
        dimensions: Optional[int] = None,
    ) -> np.ndarray:
        """See :meth:`Client.embed`."""
        return await self._run(
            self._prep_embed(
                texts, model, batch_size, timeout, priority, deadline, truncate, output_dtype, dimensions
            )
        )

    async def embed_sparse(
        self,
        texts: Union[str, Sequence[str]],
        model: Optional[str] = None,
        *,
        top_k: Optional[int] = None,
        batch_size: Optional[int] = 32,
        timeout: Optional[float] = None,
        priority: int = 0,
        deadline: Optional[float] = None,
        truncate: bool = True,
        output_dtype: str = "f32",
    ) -> SparseEmbeddings:
        """See :meth:`Client.embed_sparse`."""
        return await self._run(
            self._prep_embed_sparse(
                texts, model, top_k, batch_size, timeout, priority, deadline, truncate, output_dtype
            )
        )

    async def embed_ids(
        self,
        sequences: Sequence[Sequence[int]],
        model: Optional[str] = None,
        *,
        batch_size: Optional[int] = 32,
        timeout: Optional[float] = None,
        priority: int = 0,
        deadline: Optional[float] = None,
        output_dtype: str = "f32",
        dimensions: Optional[int] = None,
    ) -> np.ndarray:
        """See :meth:`Client.embed_ids`."""
        return await self._run(
            self._prep_embed_ids(
                sequences, model, batch_size, timeout, priority, deadline, output_dtype, dimensions
            )
        )

    async def infer(
        self,
        model: str,
        array: Any,
        *,
        batch_size: Optional[int] = None,
        timeout: Optional[float] = None,
        priority: int = 0,
        deadline: Optional[float] = None,
        output_dtype: str = "f32",
    ) -> np.ndarray:
        """See :meth:`Client.infer`."""
        return await self._run(
            self._prep_infer(model, array, batch_size, timeout, priority, deadline, output_dtype)
        )

    async def encode(
        self,
        sentences: Union[str, Sequence[str]],
        prompt_name: Optional[str] = None,
        prompt: Optional[str] = None,
        batch_size: int = 32,
        show_progress_bar: Optional[bool] = None,
        output_value: Optional[str] = "sentence_embedding",
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        device: Any = None,
        normalize_embeddings: bool = False,
        truncate_dim: Optional[int] = None,
        *,
        model: Optional[str] = None,
        timeout: Optional[float] = None,
        priority: int = 0,
        deadline: Optional[float] = None,
        truncate: bool = True,
        **kwargs: Any,
    ):
        """See :meth:`Client.encode`."""
        prep = self._prep_encode(
            sentences, prompt_name, prompt, batch_size, show_progress_bar, output_value,
            precision, convert_to_numpy, convert_to_tensor, device, normalize_embeddings,
            truncate_dim, model, timeout, priority, deadline, truncate, kwargs,
        )
        try:
            return await self._run(prep)
        finally:
            prep.progress.close()

    def stats(self) -> List[dict]:
        """See :meth:`Client.stats`."""
        loop = self._loop
        now = loop.time() if loop is not None else 0.0
        return self._core.snapshot(now)

    async def wait_connected(self, timeout: float = 10.0, every: bool = False) -> bool:
        """See :meth:`Client.wait_connected`."""
        self._start()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            up = [e.connected for e in self._core.endpoints]
            if all(up) if every else any(up):
                return True
            if loop.time() >= end:
                return False
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------ plumbing

    async def _run(self, prep: _Prepared):
        if self._closed:
            raise ConnectionLost("the client is closed")
        self._start()
        call: Call = prep.call
        loop = self._loop
        fut = loop.create_future()

        def done(_c: Call) -> None:
            if not fut.done():
                fut.set_result(None)

        call.on_done = done
        self._core.submit(call, loop.time())
        self._kick()
        try:
            await fut
        except BaseException as e:  # cancelled
            self._core.abandon(call, ConnectionLost(f"the call was cancelled: {e!r}"))
            self._kick()
            raise
        if call.error is not None:
            raise call.error
        return prep.finish(call)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if loop is self._loop:
                return
            if not self._loop.is_closed() and self._loop.is_running():
                raise RuntimeError("this AsyncClient is in use by another running event loop")
            # The loop it was bound to is gone (e.g. a second asyncio.run()):
            # start over on this one with new sockets.
            self._drop_sockets()
            self._core.reset(ConnectionLost("the event loop of these calls ended"))
        self._loop = loop
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.instance()
        for ep in self._core.endpoints:
            self._open(ep)

    def _open(self, ep: Endpoint, delay: float = 0.0) -> None:
        """A new socket for ``ep``, with its reader and monitor tasks; it
        connects after ``delay`` seconds."""
        loop = self._loop
        sock = self._ctx.socket(zmq.DEALER)
        _sockets.configure(sock, self.reconnect_interval)
        mon = sock.get_monitor_socket(_sockets.MONITOR_EVENTS)
        if delay > 0:
            loop.call_later(delay, self._connect, ep, sock)
        else:
            sock.connect(ep.address)
        self._socks[ep] = sock
        self._mons[ep] = mon
        ep.send = self._sender(sock)
        reader = loop.create_task(self._reader(ep, sock))
        self._readers[ep] = reader
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks += [reader, loop.create_task(self._monitor(ep, mon))]

    def _connect(self, ep: Endpoint, sock) -> None:
        if self._socks.get(ep) is sock:  # not replaced or closed meanwhile
            sock.connect(ep.address)

    @staticmethod
    def _sender(sock):
        def send(frames: List[Any]) -> bool:
            f = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            if not f.done():  # cannot happen with NOBLOCK; it will go out later
                return True
            exc = f.exception()
            if exc is None:
                return True
            if isinstance(exc, zmq.Again):
                return False
            raise exc

        return send

    def _kick(self) -> None:
        """Let the scheduler send what it can; arrange to be called again when it asks."""
        loop = self._loop
        if loop is None or self._closed:
            return
        wake = self._core.pump(loop.time())
        if wake is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= wake:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = loop.call_at(wake, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._kick()

    async def _reader(self, ep: Endpoint, sock) -> None:
        try:
            while True:
                # Wait for replies without taking one: only _drain takes them,
                # and it settles each at once, so no reply is ever held unread
                # in a future when the monitor handles a disconnect (and
                # replaces this socket): it would be lost with the socket.
                await sock.poll(flags=zmq.POLLIN)
                if self._drain(ep, sock, 32):
                    self._kick()
                # Let the callers, timers and monitors run between batches.
                await asyncio.sleep(0)
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception as e:  # pragma: no cover - a bug; don't leave callers hanging
            log.exception("replayd: reader for %s failed", ep.address)
            self._fail_all(e)

    async def _monitor(self, ep: Endpoint, mon) -> None:
        loop = self._loop
        try:
            while True:
                frames = await mon.recv_multipart()
                event = _sockets.event_of(frames)
                if event == _sockets.UP:
                    self._core.on_connected(ep, loop.time())
                elif event == _sockets.DOWN:
                    if self._on_down(ep):
                        self._kick()
                        return  # the socket was replaced; its new monitor takes over
                elif event == _sockets.STOPPED:
                    return
                self._kick()
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception as e:  # pragma: no cover
            log.exception("replayd: monitor for %s failed", ep.address)
            self._fail_all(e)

    def _on_down(self, ep: Endpoint) -> bool:
        """``ep``'s connection dropped. Returns whether its socket was replaced."""
        now = self._loop.time()
        if not ep.connected or self._closed:  # a failed handshake: nothing was sent on it
            self._core.on_disconnected(ep, now)
            return False
        # Replies that came before the connection dropped may still wait in the
        # socket: this event comes on the monitor's socket, and the reader task
        # may not have had its turn since. Settle them first; otherwise
        # on_disconnected counts their requests lost, re-sends them all, and
        # drops the replies as late when the reader gets to them.
        self._drain(ep, self._socks[ep])
        self._core.on_disconnected(ep, now)
        # What was sent after the connection died but before this event sits in
        # the socket's queue (no ZMQ_IMMEDIATE), and libzmq would hand it to the
        # next connection on top of the re-sends of the same requests, which
        # on_disconnected just scheduled: the restarted daemon would hold more
        # of this client's requests than max_in_flight, and past its send_hwm
        # it drops replies -- requests never answered nor re-sent. A fresh
        # socket starts empty: only what the client counts reaches the daemon.
        self._replace(ep)
        return True

    def _drain(self, ep: Endpoint, sock, limit: Optional[int] = None) -> int:
        """Settles the replies ``sock`` holds (at most ``limit``); returns how many."""
        n = 0
        while limit is None or n < limit:
            f = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)  # resolved at once
            exc = f.exception()
            if exc is not None:
                if isinstance(exc, zmq.Again):
                    break
                raise exc
            self._core.on_reply(ep, f.result(), self._loop.time())
            n += 1
        return n

    def _replace(self, ep: Endpoint) -> None:
        reader = self._readers.pop(ep, None)
        if reader is not None:
            reader.cancel()
        sock = self._socks.pop(ep)
        mon = self._mons.pop(ep)
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        sock.close(linger=0)  # drops what it still holds
        mon.close(linger=0)
        # Connect after reconnect_interval, as libzmq would have reconnected
        # the old socket: a daemon that is shutting down may still accept a
        # connection for a moment.
        self._open(ep, self.reconnect_interval)

    def _fail_all(self, e: BaseException) -> None:
        self._core.close()
        self._closed = True

    # ------------------------------------------------------------ lifetime

    async def aclose(self) -> None:
        """Close the sockets; calls in progress fail with ConnectionLost."""
        tasks = self._close()
        current = asyncio.get_running_loop()
        for t in tasks:
            if t.get_loop() is not current:
                continue
            try:
                await t
            except BaseException:
                pass

    def close(self) -> None:
        """Like :meth:`aclose`, without waiting for the background tasks to end."""
        self._close()

    def _close(self) -> List[asyncio.Task]:
        if self._closed and not self._socks:
            return []
        self._closed = True
        self._core.close()
        return self._drop_sockets()

    def _drop_sockets(self) -> List[asyncio.Task]:
        if self._timer is not None:
            try:
                self._timer.cancel()
            except RuntimeError:  # its loop is closed
                pass
            self._timer = None
            self._timer_at = None
        tasks, self._tasks = self._tasks, []
        live = []
        for t in tasks:
            try:
                if not t.done():
                    t.cancel()
                    live.append(t)
            except RuntimeError:  # its loop is closed
                pass
        for ep, sock in list(self._socks.items()):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
        for mon in self._mons.values():
            mon.close(linger=0)
        self._socks.clear()
        self._mons.clear()
        self._readers.clear()
        return live

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
