"""The asyncio client (zmq.asyncio)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import zmq
import zmq.asyncio

from . import _sockets
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
        ctx = self._ctx if self._ctx is not None else zmq.asyncio.Context.instance()
        self._ctx = ctx
        for ep in self._core.endpoints:
            sock = ctx.socket(zmq.DEALER)
            _sockets.configure(sock, self.reconnect_interval)
            mon = sock.get_monitor_socket(_sockets.MONITOR_EVENTS)
            sock.connect(ep.address)
            self._socks[ep] = sock
            self._mons[ep] = mon
            ep.send = self._sender(sock)
            self._tasks.append(loop.create_task(self._reader(ep, sock)))
            self._tasks.append(loop.create_task(self._monitor(ep, mon)))

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
        loop = self._loop
        n = 0
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                self._core.on_reply(ep, frames, loop.time())
                self._kick()
                n += 1
                if n % 32 == 0:
                    # Awaiting a reply that is already there does not yield;
                    # let the callers, timers and monitors run now and then.
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
                    self._core.on_disconnected(ep, loop.time())
                elif event == _sockets.STOPPED:
                    return
                self._kick()
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception as e:  # pragma: no cover
            log.exception("replayd: monitor for %s failed", ep.address)
            self._fail_all(e)

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
        return live

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
