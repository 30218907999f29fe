"""Socket set-up shared by both clients."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message

#: The connection events the clients act on.
MONITOR_EVENTS = (
    getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)
UP = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
DOWN = zmq.EVENT_DISCONNECTED
STOPPED = zmq.EVENT_MONITOR_STOPPED


def configure(sock: zmq.Socket, reconnect_interval: float) -> None:
    # Not ZMQ_IMMEDIATE: with it, libzmq (4.3.5) tears down a connection's
    # pipe when the peer dies, and if that happens while a multipart reply is
    # half read the DEALER aborts the process (fq.cpp:80, "!_more"). Without
    # it the pipe outlives reconnections; the client sends only to endpoints
    # whose connection is up (monitor events), and when a connection drops it
    # closes the socket and opens a new one, so that what the dead connection
    # still held (sent before the disconnect event was read) is not delivered
    # to the next one on top of the client's own re-sends.
    sock.setsockopt(zmq.IMMEDIATE, 0)
    # The client bounds what it has outstanding itself (max_in_flight); a
    # high-water mark would only make a burst block or fail.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    ivl = max(1, int(reconnect_interval * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, ivl)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
    # Kernel keep-alives find a peer whose host vanished (no FIN ever comes).
    # (ZMTP heartbeats, ZMQ_HEARTBEAT_IVL, are not used: replayd's ZeroMQ
    # implementation drops connections that send them.)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


def event_of(frames) -> int:
    return parse_monitor_message(frames)["event"]
