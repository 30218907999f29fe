//! Listening TCP sockets for a sharded ROUTER ([`super::Router::bind_shards`]):
//! N sockets bound to one address with `SO_REUSEPORT`, each handed to its own
//! libzmq ROUTER through `ZMQ_USE_FD`. Linux spreads incoming connections
//! over them (by a hash of each connection's addresses and ports), so each
//! shard's libzmq context and driver task serve a part of the clients.

use super::TransportError;
use socket2::{Domain, Protocol, Socket, Type};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;

/// libzmq's default `ZMQ_BACKLOG`, which a socket it binds itself listens with.
const BACKLOG: i32 = 100;

/// The address a `tcp://HOST:PORT` endpoint binds, when this module can bind
/// it the way libzmq would: an IPv4 literal, or `*` (every interface,
/// libzmq's `INADDR_ANY` with `ZMQ_IPV6` off, which the transport never
/// sets). Anything else (an interface name, which libzmq resolves; an IPv6
/// literal, which it refuses without `ZMQ_IPV6`; ipc://) is left to libzmq,
/// on one socket.
pub(super) fn shardable(endpoint: &str) -> Option<SocketAddr> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let ip = match host {
        "*" => Ipv4Addr::UNSPECIFIED,
        h => h.parse::<Ipv4Addr>().ok()?,
    };
    Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
}

fn socket(addr: SocketAddr, reuse_port: bool) -> std::io::Result<Socket> {
    // socket2 creates it close-on-exec (SOCK_CLOEXEC), as libzmq does.
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // As libzmq sets on its own listeners: a restart binds the port again at
    // once, whatever its old connections' TIME_WAIT.
    s.set_reuse_address(true)?;
    if reuse_port {
        s.set_reuse_port(true)?;
    }
    // libzmq accepts when the poller says readable, and treats EAGAIN (a
    // connection reset before it was accepted) as nothing to accept.
    s.set_nonblocking(true)?;
    Ok(s)
}

/// `count` sockets bound to `addr` with `SO_REUSEPORT` and listening (port 0:
/// the first one's port for all). The endpoint is for error messages.
pub(super) fn listeners(
    endpoint: &str,
    addr: SocketAddr,
    count: usize,
) -> Result<Vec<OwnedFd>, TransportError> {
    let fail = |e: std::io::Error| TransportError::Setup(format!("bind {endpoint}: {e}"));
    if addr.port() != 0 {
        // SO_REUSEPORT would let this bind join another process's group on
        // the port (one of the same user: another replayd, started by
        // mistake) and share its clients. A plain bind fails on any socket
        // already bound there, as libzmq's own bind would.
        socket(addr, false)
            .and_then(|s| s.bind(&addr.into()))
            .map_err(fail)?;
    }
    let mut bound = Vec::with_capacity(count);
    let mut at = addr;
    for _ in 0..count {
        let s = socket(at, true).map_err(fail)?;
        s.bind(&at.into()).map_err(fail)?;
        s.listen(BACKLOG).map_err(fail)?;
        if at.port() == 0 {
            let local = s
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
                .ok_or_else(|| TransportError::Setup(format!("bind {endpoint}: no local port")))?;
            at.set_port(local.port());
        }
        bound.push(OwnedFd::from(s));
    }
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_and_star_are_sharded_the_rest_left_to_libzmq() {
        assert_eq!(
            shardable("tcp://127.0.0.1:5555"),
            Some("127.0.0.1:5555".parse().unwrap())
        );
        assert_eq!(shardable("tcp://*:0"), Some("0.0.0.0:0".parse().unwrap()));
        for other in [
            "ipc:///tmp/x.sock",
            "tcp://eth0:5555",
            "tcp://[::1]:5555",
            "tcp://localhost:5555",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:*",
        ] {
            assert_eq!(shardable(other), None, "{other}");
        }
    }

    #[test]
    fn port_zero_gives_every_listener_the_first_ones_port() {
        let fds = listeners("t", "127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let ports: Vec<u16> = fds
            .into_iter()
            .map(|fd| {
                Socket::from(fd)
                    .local_addr()
                    .unwrap()
                    .as_socket()
                    .unwrap()
                    .port()
            })
            .collect();
        assert_ne!(ports[0], 0);
        assert!(ports.iter().all(|&p| p == ports[0]), "{ports:?}");
    }

    #[test]
    fn a_port_another_group_holds_is_refused() {
        let first = listeners("t", "127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let port = Socket::from(first[0].try_clone().unwrap())
            .local_addr()
            .unwrap()
            .as_socket()
            .unwrap()
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let err = listeners("tcp://again", addr, 2).unwrap_err().to_string();
        assert!(
            err.contains("bind tcp://again") && err.contains("in use"),
            "{err}"
        );
        drop(first);
        // Once they are closed, the port binds again.
        listeners("t", addr, 2).unwrap();
    }
}
