"""The blocking client."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import zmq

from . import _sockets
from ._api import _ClientBase, _Prepared
from ._protocol import SparseEmbeddings
from ._core import Endpoint
from .errors import ConnectionLost

__all__ = ["Client"]


class Client(_ClientBase):
    """A blocking client for one or more replayd daemons.

    ``endpoints`` is one ZeroMQ address (``"tcp://127.0.0.1:5555"``,
    ``"ipc:///run/replayd/replayd.sock"``), a comma-separated string of them,
    or a list. Each endpoint gets its own DEALER socket; requests are spread
    over the connected ones (least outstanding first, ties round robin), and a
    request whose daemon went away is sent again to another one (see the
    README, "Failure semantics").

    Args:
        model: default model name for :meth:`embed`, :meth:`embed_ids` and
            :meth:`encode`.
        timeout: default seconds a call waits for all its replies (``None``:
            for ever). Also sent to the daemon as ``timeout_us`` (the time
            left when each request is sent).
        max_in_flight: most requests outstanding at once (all endpoints).
            Keep it at most half the daemon's ``server.send_hwm`` (1,000 by
            default): past that many unsent replies queued for one client,
            the daemon drops replies, and libzmq frees that room only
            every ``send_hwm / 2`` replies sent.
        max_attempts: most times one request is sent (first send included)
            when its daemon is lost, draining (``unavailable``) or
            ``overloaded``.
        liveness_timeout: an endpoint that has requests outstanding and has
            sent nothing for this long is *suspect*: new requests avoid it,
            and its outstanding ones are sent again to another endpoint if
            there is one (the first reply wins). Must exceed the longest time
            one request can take. ``None`` disables the check.
        max_items_per_request, max_request_bytes: the daemon's
            ``server.max_items_per_request`` / ``max_request_bytes``; calls
            are split to respect them.
        reconnect_interval: seconds between reconnection attempts.
        prompts, default_prompt_name: as in sentence-transformers, for
            :meth:`encode`'s ``prompt_name``.
        context: a ``zmq.Context`` (default: the process's shared instance).

    The client is not meant to be used by several threads at once: calls from
    different threads are serialised (a lock). Use :class:`AsyncClient` for
    many concurrent calls, or one client per thread.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        model: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        *,
        context: Optional[zmq.Context] = None,
        **options: Any,
    ) -> None:
        super().__init__(endpoints, model, timeout, **options)
        self._ctx = context if context is not None else zmq.Context.instance()
        self._lock = threading.RLock()
        self._poller = zmq.Poller()
        self._socks: Dict[Any, Endpoint] = {}
        self._mons: Dict[Any, Endpoint] = {}
        self._connect_at: Dict[Any, Tuple[float, str]] = {}  # socket: (when, address)
        self._closed = False
        try:
            for ep in self._core.endpoints:
                self._open(ep)
        except Exception:
            self.close()
            raise

    def _open(self, ep: Endpoint, delay: float = 0.0) -> None:
        """A new socket (and its monitor) for ``ep``; it connects after
        ``delay`` seconds (at the first poll from then on)."""
        sock = self._ctx.socket(zmq.DEALER)
        _sockets.configure(sock, self.reconnect_interval)
        mon = sock.get_monitor_socket(_sockets.MONITOR_EVENTS)
        if delay > 0:
            self._connect_at[sock] = (time.monotonic() + delay, ep.address)
        else:
            sock.connect(ep.address)
        ep.send = self._sender(sock)
        self._socks[sock] = ep
        self._mons[mon] = ep
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    @staticmethod
    def _sender(sock: zmq.Socket):
        def send(frames: List[Any]) -> bool:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                return False

        return send

    # ------------------------------------------------------------- the API

    def embed(
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
        """Embeddings of ``texts``, shape ``(len(texts), dim)`` (always 2-D; a
        single string counts as a list of one). Texts are grouped longest
        first into requests of at most ``batch_size``, all sent at once
        (pipelined); rows come back in input order. ``deadline`` is absolute
        (seconds since the epoch); ``truncate=False`` makes over-long texts
        fail with :class:`TooLong`; ``output_dtype="f16"`` halves the reply
        size and returns float16; ``dimensions=n`` has the daemon keep the
        first ``n`` values of each embedding (Matryoshka), normalised again
        when the model normalises (default: the model folder's
        ``truncate_dim``, else all)."""
        return self._run(
            self._prep_embed(
                texts, model, batch_size, timeout, priority, deadline, truncate, output_dtype, dimensions
            )
        )

    def embed_sparse(
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
        """A sparse encoder's (SPLADE's) vocabulary weights for ``texts``: a
        :class:`SparseEmbeddings` with one row per text, in input order,
        holding each text's non-zero weights (``top_k=k``: its ``k`` largest)
        as sentence-transformers' ``SparseEncoder.encode`` computes them.
        ``SparseEmbeddings.to_scipy()`` gives a ``scipy.sparse.csr_matrix``,
        ``to_dense()`` a ``(len(texts), vocab_size)`` array. The other
        arguments are :meth:`embed`'s."""
        return self._run(
            self._prep_embed_sparse(
                texts, model, top_k, batch_size, timeout, priority, deadline, truncate, output_dtype
            )
        )

    def embed_ids(
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
        """Embeddings of pre-tokenised inputs: each sequence a list of token
        ids, special tokens included (``[101, ..., 102]`` for BERT uncased).
        Shape ``(len(sequences), dim)``."""
        return self._run(
            self._prep_embed_ids(
                sequences, model, batch_size, timeout, priority, deadline, output_dtype, dimensions
            )
        )

    def infer(
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
        """Run an MLP model on ``array`` (``[rows, features]``, converted to
        float32; a 1-D array is one row and gives a 1-D result). Rows are
        split into requests of at most ``batch_size`` (default: the per-request
        limit), sent pipelined."""
        return self._run(
            self._prep_infer(model, array, batch_size, timeout, priority, deadline, output_dtype)
        )

    def encode(
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
        """``SentenceTransformer.encode``, computed by replayd.

        A single string gives a 1-D float32 array, a list a 2-D one
        ``(len, dim)``. ``convert_to_tensor=True`` gives a torch tensor (on
        ``device`` if given), ``convert_to_numpy=False`` a list of tensors:
        both need torch installed. ``normalize_embeddings`` L2-normalises here
        (all-MiniLM-L6-v2 already comes normalised). ``batch_size`` is the
        number of texts per request; every request of the call is in flight
        at once. ``prompt``/``prompt_name`` prepend a prompt as
        sentence-transformers does (names from ``Client(prompts=...)``).
        ``output_value`` other than ``"sentence_embedding"`` and ``precision``
        other than ``"float32"`` are not supported. ``pool`` and
        ``chunk_size`` are accepted and ignored; other unknown keywords raise
        TypeError. The keywords after ``*`` are replayd's own.
        """
        prep = self._prep_encode(
            sentences, prompt_name, prompt, batch_size, show_progress_bar, output_value,
            precision, convert_to_numpy, convert_to_tensor, device, normalize_embeddings,
            truncate_dim, model, timeout, priority, deadline, truncate, kwargs,
        )
        try:
            return self._run(prep)
        finally:
            prep.progress.close()

    def stats(self) -> List[dict]:
        """Per endpoint: connected, suspect, draining, in flight, and counters
        (sent, replies, lost, connects, disconnects)."""
        with self._lock:
            self._poll_once(0)
            return self._core.snapshot(time.monotonic())

    def wait_connected(self, timeout: float = 10.0, every: bool = False) -> bool:
        """Block until one (or, with ``every``, each) of the endpoints is connected; returns
        whether that happened within ``timeout``. Calls do not need this:
        they wait for a connection themselves, within their timeout."""
        end = time.monotonic() + timeout
        with self._lock:
            while True:
                up = [e.connected for e in self._core.endpoints]
                if (all(up) if every else any(up)):
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._poll_once(min(left, 0.1))

    # ------------------------------------------------------------ plumbing

    def _run(self, prep: _Prepared):
        call = prep.call
        with self._lock:
            if self._closed:
                raise ConnectionLost("the client is closed")
            core = self._core
            core.submit(call, time.monotonic())
            try:
                while not call.done:
                    now = time.monotonic()
                    wake = core.pump(now)
                    if call.done:
                        break
                    wait = 1.0 if wake is None else min(1.0, max(0.0, wake - now))
                    self._poll_once(wait)
            except BaseException as e:  # KeyboardInterrupt included
                core.abandon(call, ConnectionLost(f"the call was interrupted: {e!r}"))
                raise
            if call.error is not None:
                raise call.error
            return prep.finish(call)

    def _poll_once(self, wait: float) -> None:
        if self._connect_at:
            now = time.monotonic()
            for sock, (at, address) in list(self._connect_at.items()):
                if at <= now:
                    del self._connect_at[sock]
                    sock.connect(address)
                else:
                    wait = min(wait, at - now)
        ms = int(wait * 1000 + 0.999)
        ready = dict(self._poller.poll(ms))
        if not ready:
            return
        # Replies first: those a dying connection delivered before it closed
        # settle their requests instead of being re-sent.
        for sock, ep in self._socks.items():
            if sock in ready:
                self._drain(sock, ep)
        for mon, ep in list(self._mons.items()):
            if mon in ready:
                while True:
                    try:
                        frames = mon.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._on_event(ep, _sockets.event_of(frames)):
                        break  # that monitor was closed with its socket

    def _drain(self, sock: zmq.Socket, ep: Endpoint) -> None:
        for _ in range(100_000):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._core.on_reply(ep, frames, time.monotonic())

    def _on_event(self, ep: Endpoint, event: int) -> bool:
        """Returns whether ``ep``'s socket was replaced."""
        now = time.monotonic()
        if event == _sockets.UP:
            self._core.on_connected(ep, now)
        elif event == _sockets.DOWN:
            if not ep.connected:  # a handshake that failed: nothing was sent on it
                self._core.on_disconnected(ep, now)
                return False
            sock = next(s for s, e in self._socks.items() if e is ep)
            self._drain(sock, ep)  # replies that came since the poll
            self._core.on_disconnected(ep, now)
            # What was sent after the connection died but before this event
            # still sits in the socket (no ZMQ_IMMEDIATE) and would go to the
            # next connection on top of the re-sends on_disconnected scheduled:
            # more of our requests at the daemon than max_in_flight, and past
            # its send_hwm it drops replies (never answered nor re-sent). A
            # fresh socket starts empty. (See AsyncClient._on_down.)
            self._replace(ep, sock)
            return True
        return False

    def _replace(self, ep: Endpoint, sock: zmq.Socket) -> None:
        mon = next(m for m, e in self._mons.items() if e is ep)
        for s in (sock, mon):
            self._poller.unregister(s)
        del self._socks[sock]
        del self._mons[mon]
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

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the sockets; calls in progress (other threads) fail with ConnectionLost."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._core.close()
        for sock in list(self._socks):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
        for mon in list(self._mons):
            mon.close(linger=0)
        self._socks.clear()
        self._mons.clear()
        self._connect_at.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

