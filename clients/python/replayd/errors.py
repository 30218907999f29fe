"""Exceptions raised by the replayd clients.

Every error a daemon replies with becomes an instance of the subclass for its
protocol error code (see docs/protocol.md, "Error codes"); a code this client
does not know (a later protocol version may add some) becomes a plain
:class:`ReplaydError`. Failures seen only by the client (no reply in time, a
request lost with its daemon too often, no daemon reachable) have their own
subclasses with codes that never appear on the wire.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "ReplaydError",
    "BadRequest",
    "UnknownModel",
    "TooLong",
    "Overloaded",
    "DeadlineExceeded",
    "Unavailable",
    "Internal",
    "Timeout",
    "ConnectionLost",
    "NoHealthyEndpoint",
    "ProtocolError",
    "error_from_reply",
]


class ReplaydError(Exception):
    """Base class of every replayd client error.

    Attributes:
        code: the protocol error code (``"bad_request"``, ...), or for
            client-side failures ``"timeout"``, ``"connection_lost"``,
            ``"no_healthy_endpoint"`` or ``"protocol_error"``.
        message: the daemon's (or the client's) explanation, for humans.
        id: the ``id`` of the request that failed (``None`` when the failure
            belongs to no single request).
        indices: positions, in the input of the call, of the texts / id
            sequences / rows that the failed request carried (a call is split
            into several requests; the daemon's message counts from 0 within
            its request). ``None`` when unknown.
        endpoint: the endpoint that replied, where known.
    """

    code: str = "error"

    def __init__(
        self,
        code: Optional[str] = None,
        message: str = "",
        id: Optional[int] = None,
        *,
        indices: Optional[Sequence[int]] = None,
        endpoint: Optional[str] = None,
    ) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.id = id
        self.indices = list(indices) if indices is not None else None
        self.endpoint = endpoint
        super().__init__(self.code, message, id)

    def __str__(self) -> str:
        s = f"{self.code}: {self.message}"
        extra = []
        if self.id is not None:
            extra.append(f"request id {self.id}")
        if self.endpoint:
            extra.append(self.endpoint)
        if self.indices is not None:
            shown = ", ".join(str(i) for i in self.indices[:8])
            if len(self.indices) > 8:
                shown += f", ... ({len(self.indices)} in all)"
            extra.append(f"inputs [{shown}] of this call")
        if extra:
            s += " (" + "; ".join(extra) + ")"
        return s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, {self.id!r})"

    def __reduce__(self):  # picklable with its attributes
        return (
            _rebuild,
            (type(self), self.code, self.message, self.id, self.indices, self.endpoint),
        )


def _rebuild(cls, code, message, id, indices, endpoint):
    return cls(code, message, id, indices=indices, endpoint=endpoint)


class _CodeError(ReplaydError):
    """An error with a fixed protocol code; ``code`` may be omitted."""

    def __init__(self, *args, **kwargs) -> None:
        # Accept both Sub(message) and Sub(code, message, id).
        if args and args[0] == type(self).code:
            super().__init__(*args, **kwargs)
        else:
            super().__init__(type(self).code, *args, **kwargs)


class BadRequest(_CodeError):
    """Malformed or inconsistent request (wrong shape or dtype, too many items, ...). Not retried."""

    code = "bad_request"


class UnknownModel(_CodeError):
    """No model of that name is served (the message lists the served ones). Not retried."""

    code = "unknown_model"


class TooLong(_CodeError):
    """An input is longer than the model accepts (``truncate=False``, or an id sequence over the maximum). Not retried."""

    code = "too_long"


class Overloaded(_CodeError):
    """The model's queue was full; raised after the client's own retries with back-off ran out."""

    code = "overloaded"


class DeadlineExceeded(_CodeError):
    """The request's deadline passed before it could start."""

    code = "deadline_exceeded"


class Unavailable(_CodeError):
    """The daemon is shutting down; raised after the client's retries elsewhere ran out."""

    code = "unavailable"


class Internal(_CodeError):
    """An unexpected failure inside the daemon. Not retried (the daemon already retried)."""

    code = "internal"


class Timeout(_CodeError, TimeoutError):
    """No reply within the call's timeout (client-side; the daemon may still run the request)."""

    code = "timeout"


class ConnectionLost(_CodeError, ConnectionError):
    """A request was lost with its daemon (connection dropped or daemon silent) on every attempt."""

    code = "connection_lost"


class NoHealthyEndpoint(ConnectionLost):
    """The call's timeout passed while no endpoint was connected, so the request could not be (re)sent."""

    code = "no_healthy_endpoint"


class ProtocolError(_CodeError):
    """The daemon's reply did not follow docs/protocol.md (e.g. missing tensor frame)."""

    code = "protocol_error"


_BY_CODE = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownModel,
        TooLong,
        Overloaded,
        DeadlineExceeded,
        Unavailable,
        Internal,
    )
}


def error_from_reply(
    header: dict,
    *,
    indices: Optional[Sequence[int]] = None,
    endpoint: Optional[str] = None,
) -> ReplaydError:
    """The exception for an error reply header (``status = "error"``)."""
    code = header.get("code")
    code = code if isinstance(code, str) else "error"
    message = header.get("message")
    message = message if isinstance(message, str) else ""
    rid = header.get("id")
    rid = rid if isinstance(rid, int) else None
    cls = _BY_CODE.get(code)
    if cls is None:
        return ReplaydError(code, message, rid, indices=indices, endpoint=endpoint)
    return cls(code, message, rid, indices=indices, endpoint=endpoint)
