"""The request scheduler shared by :class:`~replayd.Client` and
:class:`~replayd.AsyncClient`.

It is pure bookkeeping with no I/O of its own: the clients feed it replies and
connection events from their sockets and call :meth:`Core.pump`, which sends
what can be sent (through each endpoint's non-blocking ``send``), re-sends what
was lost, and fails calls whose time is up. Everything here runs on one thread
(the caller's for the sync client, the event loop's for the async one).

Vocabulary: a *call* is one API call (``embed``, ``infer``...); it is split
into *jobs*, one protocol request each; every time a job is sent it is an
*attempt* with a fresh request id. The first reply to any attempt of a job
settles it; replies to other attempts are dropped.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _protocol as proto
from .errors import (
    ConnectionLost,
    DeadlineExceeded,
    NoHealthyEndpoint,
    ProtocolError,
    ReplaydError,
    Timeout,
    error_from_reply,
)


class Endpoint:
    """One daemon address and the state the scheduler keeps about it."""

    def __init__(self, address: str, index: int) -> None:
        self.address = address
        self.index = index
        self.send: Callable[[List[Any]], bool] = lambda frames: False
        self.connected = False
        #: no reply for ``liveness_timeout`` while requests were outstanding
        self.suspect = False
        #: replied ``unavailable`` (draining): no new requests until then
        self.blocked_until = 0.0
        #: a send found no connection (the event saying so may be on its way)
        self.paused_until = 0.0
        self.inflight: Dict[int, "Attempt"] = {}
        #: last time it showed life (a reply, a connection), or became busy
        self.last_progress = 0.0
        # counters, for Client.stats()
        self.sent = 0
        self.replies = 0
        self.lost = 0
        self.disconnects = 0
        self.connects = 0
        self.peak_in_flight = 0
        self.overloaded = 0
        self.unavailable = 0
        self.resent = 0

    def snapshot(self, now: float) -> dict:
        return {
            "endpoint": self.address,
            "connected": self.connected,
            "suspect": self.suspect,
            "draining": self.blocked_until > now,
            "in_flight": len(self.inflight),
            "peak_in_flight": self.peak_in_flight,
            "sent": self.sent,
            "replies": self.replies,
            "lost": self.lost,
            "overloaded": self.overloaded,
            "unavailable": self.unavailable,
            "resent": self.resent,
            "connects": self.connects,
            "disconnects": self.disconnects,
        }


class Attempt:
    __slots__ = ("id", "job", "ep", "sent_at", "duplicated")

    def __init__(self, rid: int, job: "Job", ep: Endpoint, sent_at: float) -> None:
        self.id = rid
        self.job = job
        self.ep = ep
        self.sent_at = sent_at
        self.duplicated = False


class Job:
    """One protocol request of a call."""

    __slots__ = (
        "call", "pos", "fields", "frames", "indices", "rows", "sends", "live", "avoid", "done", "queued",
    )

    def __init__(self, call: "Call", pos: int, fields: dict, frames: List[Any], indices: List[int]):
        self.call = call
        self.pos = pos
        self.fields = fields
        self.frames = frames
        self.indices = indices
        self.rows = len(indices)
        self.sends = 0
        self.live: set = set()
        self.avoid: set = set()
        self.done = False
        self.queued = False


class Call:
    """A group of jobs whose results are wanted together."""

    def __init__(self, timeout: Optional[float], deadline_unix: Optional[float]) -> None:
        self.timeout = timeout
        self.deadline: Optional[float] = None  # monotonic, set on submit
        self.deadline_unix = deadline_unix
        self.jobs: List[Job] = []
        self.results: List[Any] = []
        self.remaining = 0
        self.done = False
        self.error: Optional[BaseException] = None
        self.on_done: Optional[Callable[["Call"], None]] = None
        #: called with the number of rows of each request that succeeds
        self.on_progress: Optional[Callable[[int], None]] = None

    def add(self, fields: dict, frames: List[Any], indices: List[int]) -> None:
        self.jobs.append(Job(self, len(self.jobs), fields, frames, indices))
        self.results.append(None)

    def outputs(self) -> List[Any]:
        return [(job.indices, self.results[job.pos]) for job in self.jobs]


class Core:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        max_in_flight: int,
        max_attempts: int,
        liveness_timeout: Optional[float],
        backoff: float,
        backoff_max: float,
        unavailable_backoff: float,
    ) -> None:
        self.endpoints = [Endpoint(a, i) for i, a in enumerate(addresses)]
        self.max_in_flight = max_in_flight
        self.max_attempts = max_attempts
        self.liveness_timeout = liveness_timeout
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.unavailable_backoff = unavailable_backoff
        self.attempts: Dict[int, Attempt] = {}
        # jobs waiting to be sent, oldest first; re-sends are put in front
        self.queue: List[Job] = []
        self._queue_head = 0
        self.delayed: list = []  # heap of (not_before, seq, job)
        self.deadlines: list = []  # heap of (deadline, seq, call)
        self._seq = itertools.count()
        # Ids are unique per client for its lifetime; a random start keeps two
        # clients of one process apart in the daemon's logs.
        self._ids = itertools.count(random.randrange(1, 1 << 40))
        self._rr = 0
        self.closed = False

    # ------------------------------------------------------------------ calls

    def submit(self, call: Call, now: float) -> None:
        if self.closed:
            raise ConnectionLost("the client is closed")
        if call.timeout is not None:
            call.deadline = now + call.timeout
            heapq.heappush(self.deadlines, (call.deadline, next(self._seq), call))
        call.remaining = len(call.jobs)
        if not call.jobs:
            self._finish(call, None)
            return
        for job in call.jobs:
            job.queued = True
        self.queue.extend(call.jobs)

    def abandon(self, call: Call, error: Optional[BaseException] = None) -> None:
        """Stop caring about ``call`` (cancelled, interrupted, failed)."""
        if call.done:
            return
        self._finish(call, error or ConnectionLost("the call was abandoned"))

    def reset(self, error: BaseException) -> None:
        """Fail every call and forget every connection (the sockets are being
        replaced); counters are kept."""
        self._abandon_all(error)
        self.attempts.clear()
        self.queue = []
        self._queue_head = 0
        self.delayed = []
        self.deadlines = []
        for ep in self.endpoints:
            ep.connected = False
            ep.suspect = False
            ep.blocked_until = ep.paused_until = 0.0
            ep.inflight.clear()

    def close(self) -> None:
        self.closed = True
        self._abandon_all(ConnectionLost("the client was closed"))

    def _abandon_all(self, error: BaseException) -> None:
        calls = {a.job.call for a in self.attempts.values()}
        calls.update(job.call for job in self._queued())
        calls.update(job.call for _, _, job in self.delayed)
        for _, _, call in self.deadlines:
            calls.add(call)
        for call in calls:
            self.abandon(call, error)

    def _queued(self) -> List[Job]:
        return self.queue[self._queue_head :]

    def _finish(self, call: Call, error: Optional[BaseException]) -> None:
        call.done = True
        call.error = error
        for job in call.jobs:
            job.done = True
            self._drop_attempts(job)
        if call.on_done is not None:
            call.on_done(call)

    def _drop_attempts(self, job: Job) -> None:
        for rid in job.live:
            att = self.attempts.pop(rid, None)
            if att is not None:
                att.ep.inflight.pop(rid, None)
        job.live.clear()

    # ------------------------------------------------------------- dispatch

    def pump(self, now: float) -> Optional[float]:
        """Send, re-send and expire what is due; returns when to call again
        (a monotonic time), or None if nothing is pending on time."""
        self._expire(now)
        self._release_delayed(now)
        self._check_liveness(now)
        self._dispatch(now)
        return self._next_wakeup(now)

    def _push_front(self, job: Job) -> None:
        # Re-sends go first: they are the oldest work.
        if job.queued or job.done:
            return
        job.queued = True
        if self._queue_head > 0:
            self._queue_head -= 1
            self.queue[self._queue_head] = job
        else:
            self.queue.insert(0, job)

    def _dispatch(self, now: float) -> None:
        q = self.queue
        while self._queue_head < len(q) and len(self.attempts) < self.max_in_flight:
            job = q[self._queue_head]
            if job.done:
                job.queued = False
                self._queue_head += 1
                continue
            ep = self._pick(now, job.avoid)
            if ep is None:
                break
            if not self._send(job, ep, now):
                continue  # _send paused that endpoint; try another
            job.queued = False
            self._queue_head += 1
        if self._queue_head > 1024 and self._queue_head * 2 > len(q):
            del q[: self._queue_head]
            self._queue_head = 0
        elif self._queue_head == len(q) and q:
            q.clear()
            self._queue_head = 0

    def _candidates(self, now: float) -> List[Endpoint]:
        eps = [
            e
            for e in self.endpoints
            if e.connected and not e.suspect and e.blocked_until <= now and e.paused_until <= now
        ]
        if not eps:  # a slow daemon is better than none
            eps = [
                e
                for e in self.endpoints
                if e.connected and e.blocked_until <= now and e.paused_until <= now
            ]
        return eps

    def _pick(self, now: float, avoid: set) -> Optional[Endpoint]:
        eps = self._candidates(now)
        if not eps:
            return None
        if avoid and len(eps) > 1:
            others = [e for e in eps if e.index not in avoid]
            if others:
                eps = others
        n = len(self.endpoints)
        # least outstanding; ties broken round robin
        best = min(eps, key=lambda e: (len(e.inflight), (e.index - self._rr) % n))
        self._rr = (best.index + 1) % n
        return best

    def _send(self, job: Job, ep: Endpoint, now: float) -> bool:
        rid = next(self._ids)
        head = dict(job.fields)
        head["v"] = proto.VERSION
        head["id"] = rid
        call = job.call
        if call.deadline is not None:
            head["timeout_us"] = max(1, int((call.deadline - now) * 1_000_000))
        frames = [proto.pack_header(head)]
        frames.extend(job.frames)
        if not ep.send(frames):
            ep.paused_until = now + 0.02
            return False
        if not ep.inflight:
            ep.last_progress = now
        att = Attempt(rid, job, ep, now)
        self.attempts[rid] = att
        ep.inflight[rid] = att
        if len(ep.inflight) > ep.peak_in_flight:
            ep.peak_in_flight = len(ep.inflight)
        ep.sent += 1
        if job.sends:
            ep.resent += 1
        job.live.add(rid)
        job.sends += 1
        return True

    # -------------------------------------------------------------- replies

    def on_reply(self, ep: Endpoint, frames: Sequence[Any], now: float) -> None:
        ep.replies += 1
        ep.last_progress = now
        if ep.suspect:
            ep.suspect = False
        try:
            head = proto.unpack_header(frames[0])
        except Exception:
            return  # not ours to understand; nothing can be matched to it
        rid = head.get("id")
        att = self.attempts.pop(rid, None) if isinstance(rid, int) else None
        if att is None:
            return  # late reply of a settled, re-sent or abandoned request
        att.ep.inflight.pop(rid, None)
        job = att.job
        job.live.discard(rid)
        if job.done:
            return
        call = job.call
        status = head.get("status")
        if status == "ok":
            try:
                out = proto.decode_output(head, frames)
                proto.check_rows(out, job.rows, rid)
            except ProtocolError as e:
                e.endpoint = ep.address
                e.indices = list(job.indices)
                self._finish(call, e)
                return
            job.done = True
            self._drop_attempts(job)
            call.results[job.pos] = out
            call.remaining -= 1
            if call.on_progress is not None:
                call.on_progress(job.rows)
            if call.remaining == 0:
                self._finish(call, None)
            return
        err = error_from_reply(head, indices=job.indices, endpoint=ep.address)
        if err.code == "overloaded":
            ep.overloaded += 1
            self._retry(job, ep, now, err, delay=self._backoff(job.sends))
        elif err.code == "unavailable":
            ep.unavailable += 1
            ep.blocked_until = now + self.unavailable_backoff
            self._retry(job, ep, now, err, delay=0.0)
        else:
            self._finish(call, err)

    def _backoff(self, sends: int) -> float:
        d = min(self.backoff_max, self.backoff * (2 ** max(0, sends - 1)))
        return d * (0.5 + random.random() / 2)

    def _retry(self, job: Job, ep: Endpoint, now: float, err: ReplaydError, delay: float) -> None:
        if job.done or job.live:
            return  # another attempt is still out; wait for it
        call = job.call
        if job.sends >= self.max_attempts:
            err.message = f"{err.message} (gave up after {job.sends} attempts)"
            self._finish(call, err)
            return
        if call.deadline_unix is not None and time.time() >= call.deadline_unix:
            self._finish(
                call,
                DeadlineExceeded(
                    f"the deadline passed before the request could be re-sent (last error: {err.code}: {err.message})",
                    indices=job.indices,
                ),
            )
            return
        job.avoid.add(ep.index)
        if delay > 0:
            heapq.heappush(self.delayed, (now + delay, next(self._seq), job))
        else:
            self._push_front(job)

    # ------------------------------------------------------ connection events

    def on_connected(self, ep: Endpoint, now: float) -> None:
        ep.connected = True
        ep.suspect = False
        ep.paused_until = 0.0
        ep.last_progress = now
        ep.connects += 1

    def on_disconnected(self, ep: Endpoint, now: float) -> None:
        """The connection dropped: every request on it is lost."""
        if ep.connected:
            ep.disconnects += 1
        ep.connected = False
        ep.suspect = False
        lost = list(ep.inflight.values())
        ep.inflight.clear()
        ep.lost += len(lost)
        for att in lost:
            self.attempts.pop(att.id, None)
            att.job.live.discard(att.id)
        for att in lost:
            self._retry(
                att.job,
                ep,
                now,
                ConnectionLost(
                    f"the connection to {ep.address} dropped with the request in flight",
                    att.id,
                    indices=att.job.indices,
                    endpoint=ep.address,
                ),
                delay=0.0,
            )

    def _check_liveness(self, now: float) -> None:
        lt = self.liveness_timeout
        if lt is None:
            return
        for ep in self.endpoints:
            if not ep.inflight or not ep.connected or now - ep.last_progress < lt:
                continue
            if not ep.suspect:
                ep.suspect = True
            # Duplicate its requests on another endpoint, if there is one; the
            # first reply wins. With no other endpoint, keep waiting.
            others = [e for e in self._candidates(now) if e is not ep and not e.suspect]
            if not others:
                continue
            for att in list(ep.inflight.values()):
                job = att.job
                if att.duplicated or job.done or len(job.live) > 1:
                    continue
                att.duplicated = True
                if job.sends >= self.max_attempts:
                    continue
                job.avoid.add(ep.index)
                self._push_front(job)

    def _release_delayed(self, now: float) -> None:
        while self.delayed and self.delayed[0][0] <= now:
            _, _, job = heapq.heappop(self.delayed)
            if not job.done:
                self._push_front(job)

    def _expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, call = heapq.heappop(self.deadlines)
            if call.done:
                continue
            pending = [j for j in call.jobs if not j.done]
            sent = [j for j in pending if j.live]
            where = sorted({self.attempts[r].ep.address for j in sent for r in j.live if r in self.attempts})
            if not any(e.connected for e in self.endpoints):
                err: ReplaydError = NoHealthyEndpoint(
                    f"no endpoint of {[e.address for e in self.endpoints]} was connected "
                    f"within the timeout of {call.timeout:g} s",
                    indices=pending[0].indices if len(pending) == 1 else None,
                )
            else:
                err = Timeout(
                    f"no reply within {call.timeout:g} s: {len(pending)} of {len(call.jobs)} "
                    f"requests unanswered ({len(sent)} in flight"
                    + (f" on {', '.join(where)}" if where else "")
                    + ")",
                    next(iter(pending[0].live)) if len(pending) == 1 and pending[0].live else None,
                    indices=pending[0].indices if len(pending) == 1 else None,
                )
            self._finish(call, err)
        # keep the heap from holding on to many finished calls
        if len(self.deadlines) > 4096:
            self.deadlines = [d for d in self.deadlines if not d[2].done]
            heapq.heapify(self.deadlines)

    def _next_wakeup(self, now: float) -> Optional[float]:
        t: Optional[float] = None

        def at(x: float) -> None:
            nonlocal t
            if t is None or x < t:
                t = x

        while self.deadlines and self.deadlines[0][2].done:
            heapq.heappop(self.deadlines)
        if self.deadlines:
            at(self.deadlines[0][0])
        if self.delayed:
            at(self.delayed[0][0])
        waiting = self._queue_head < len(self.queue)
        for ep in self.endpoints:
            if self.liveness_timeout is not None and ep.inflight and ep.connected:
                at(max(now, ep.last_progress + self.liveness_timeout))
            if waiting:
                for x in (ep.blocked_until, ep.paused_until):
                    if x > now:
                        at(x)
        return t

    # ---------------------------------------------------------------- info

    def has_work(self) -> bool:
        return bool(self.attempts) or self._queue_head < len(self.queue) or bool(self.delayed)

    def snapshot(self, now: float) -> List[dict]:
        return [e.snapshot(now) for e in self.endpoints]
