//! Tests over real sockets (tcp on 127.0.0.1, ipc in a temporary directory),
//! with libzmq peers and raw TCP peers speaking hand-made ZMTP.

use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn b(s: &[u8]) -> Bytes {
    Bytes::copy_from_slice(s)
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap()
}

fn tcp_port(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// Serves an echo: each request's frames come back, prefixed by "re".
fn spawn_echo(router: Router) -> Arc<TransportStats> {
    let stats = router.stats();
    let (mut rx, tx) = router.split();
    tokio::spawn(async move {
        loop {
            match rx.recv().await {
                Ok(m) => {
                    let mut out = vec![b(b"re")];
                    out.extend(m.frames);
                    tx.send(&m.peer, out).unwrap();
                }
                Err(TransportError::Rejected { peer, reason }) => {
                    let _ = tx.send(&peer, vec![b(b"rejected"), Bytes::from(reason)]);
                }
                Err(TransportError::Closed) | Err(TransportError::Setup(_)) => break,
            }
        }
    });
    stats
}

/// [`Router::loopback`] split: its endpoint, counters and halves.
async fn tcp_router_split(
    limits: &TransportLimits,
) -> (String, Arc<TransportStats>, RouterReceiver, RouterSender) {
    let router = Router::loopback(limits).await;
    let endpoint = router.endpoint().to_string();
    let stats = router.stats();
    let (rx, tx) = router.split();
    (endpoint, stats, rx, tx)
}

/// A DEALER connected without security, split into its halves.
async fn connect(endpoint: &str, limits: &TransportLimits) -> (DealerReceiver, DealerSender) {
    Dealer::connect(endpoint, limits, &Security::None)
        .await
        .unwrap()
        .split()
}

async fn round_trip(endpoint: &str, limits: &TransportLimits, security: &Security) -> Vec<Bytes> {
    let (mut rx, tx) = Dealer::connect(endpoint, limits, security)
        .await
        .unwrap()
        .split();
    tx.send(vec![b(b"header"), b(b"payload")]).unwrap();
    timeout(WAIT, rx.recv()).await.unwrap().unwrap().frames
}

/// A tcp ROUTER echo on a free port; its endpoint.
async fn echo_server(limits: &TransportLimits) -> String {
    let router = Router::loopback(limits).await;
    let endpoint = router.endpoint().to_string();
    spawn_echo(router);
    endpoint
}

/// DEALERs on the process's shared context (`shared_context`) each get
/// their own replies, and closing some leaves the others serving.
#[tokio::test]
async fn dealers_on_the_shared_context_are_independent() {
    let limits = TransportLimits::default();
    let endpoint = echo_server(&limits).await;
    let shared = TransportLimits {
        shared_context: true,
        io_threads: 2,
        ..TransportLimits::default()
    };
    let mut dealers = Vec::new();
    for _ in 0..6 {
        dealers.push(connect(&endpoint, &shared).await);
    }
    for round in 0..3u8 {
        for (i, (_, tx)) in dealers.iter().enumerate() {
            tx.send(vec![b(&[round, i as u8])]).unwrap();
        }
        for (i, (rx, _)) in dealers.iter_mut().enumerate() {
            let frames = timeout(WAIT, rx.recv()).await.unwrap().unwrap().frames;
            assert_eq!(frames, vec![b(b"re"), b(&[round, i as u8])]);
        }
        // Fewer sockets each round: the context outlives the closed ones.
        dealers.truncate(dealers.len() - 2);
    }
    let reply = round_trip(&endpoint, &shared, &Security::None).await;
    assert_eq!(reply, vec![b(b"re"), b(b"header"), b(b"payload")]);
}

/// ZMTP 3.0 greeting (NULL mechanism, as client) and READY(DEALER).
fn zmtp_handshake(stream: &mut TcpStream) {
    let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    greeting.extend_from_slice(b"NULL");
    greeting.resize(64, 0);
    stream.write_all(&greeting).unwrap();
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).unwrap();
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    let mut ready = vec![0x04, body.len() as u8];
    ready.extend_from_slice(&body);
    stream.write_all(&ready).unwrap();
}

/// Reads until EOF or error; true if the server closed the connection.
fn closed_by_server(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut sink = Vec::new();
    match stream.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[tokio::test]
async fn round_trip_over_tcp_with_port_zero_and_over_ipc() {
    let limits = TransportLimits::default();
    let router = Router::loopback(&limits).await;
    let endpoint = router.endpoint().to_string();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    assert_ne!(tcp_port(&endpoint), 0);
    spawn_echo(router);
    let reply = round_trip(&endpoint, &limits, &Security::None).await;
    assert_eq!(reply, vec![b(b"re"), b(b"header"), b(b"payload")]);

    let dir = tempfile::tempdir().unwrap();
    let ipc = format!("ipc://{}/t.sock", dir.path().display());
    let router = Router::bind(&ipc, &limits, &Security::None).await.unwrap();
    assert_eq!(router.endpoint(), ipc);
    spawn_echo(router);
    let reply = round_trip(&ipc, &limits, &Security::None).await;
    assert_eq!(reply, vec![b(b"re"), b(b"header"), b(b"payload")]);
}

#[tokio::test]
async fn dealer_bind_and_connect_over_ipc_like_the_worker_link() {
    let limits = TransportLimits::default();
    let dir = tempfile::tempdir().unwrap();
    let ipc = format!("ipc://{}/w.sock", dir.path().display());
    let (mut daemon_rx, daemon_tx) = Dealer::bind(&ipc, &limits, &Security::None)
        .await
        .unwrap()
        .split();
    let (mut worker_rx, worker_tx) = connect(&ipc, &limits).await;
    worker_tx.send(vec![b(b"ready")]).unwrap();
    let m = timeout(WAIT, daemon_rx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames, vec![b(b"ready")]);
    let big = Bytes::from(vec![7u8; 1 << 20]);
    daemon_tx.send(vec![b(b"batch"), big.clone()]).unwrap();
    let m = timeout(WAIT, worker_rx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames, vec![b(b"batch"), big]);
}

#[tokio::test]
async fn a_thousand_pipelined_requests_come_back_matched() {
    let limits = TransportLimits::default();
    // Replies in a scrambled order, from separate tasks.
    let (endpoint, _, mut rx, tx) = tcp_router_split(&limits).await;
    tokio::spawn(async move {
        while let Ok(m) = rx.recv().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let id = u32::from_le_bytes(m.frames[0][..4].try_into().unwrap());
                tokio::time::sleep(Duration::from_micros(u64::from(id % 7) * 100)).await;
                tx.send(
                    &m.peer,
                    vec![m.frames[0].clone(), Bytes::from(vec![1u8; 1536])],
                )
                .unwrap();
            });
        }
    });
    let (mut crx, ctx) = connect(&endpoint, &limits).await;
    for id in 0u32..1000 {
        ctx.send(vec![Bytes::copy_from_slice(&id.to_le_bytes()), b(&[0; 60])])
            .unwrap();
    }
    let mut seen = vec![false; 1000];
    for _ in 0..1000 {
        let m = timeout(WAIT, crx.recv()).await.unwrap().unwrap();
        let id = u32::from_le_bytes(m.frames[0][..4].try_into().unwrap()) as usize;
        assert!(!seen[id], "reply {id} twice");
        seen[id] = true;
        assert_eq!(m.frames[1].len(), 1536);
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(ctx.stats().snapshot().dropped_sends, 0);
}

#[tokio::test]
async fn a_libzmq_req_peer_works_when_the_delimiter_is_echoed() {
    let limits = TransportLimits::default();
    let (endpoint, _, mut rx, tx) = tcp_router_split(&limits).await;
    tokio::spawn(async move {
        while let Ok(m) = rx.recv().await {
            // A REQ peer's frames start with the empty delimiter; the
            // application strips it and puts it back in front of the reply.
            assert!(m.frames[0].is_empty(), "no delimiter: {:?}", m.frames);
            let mut out = vec![Bytes::new(), b(b"re")];
            out.extend(m.frames[1..].iter().cloned());
            tx.send(&m.peer, out).unwrap();
        }
    });
    let reply = tokio::task::spawn_blocking(move || {
        let ctx = zmq::Context::new();
        let req = ctx.socket(zmq::REQ).unwrap();
        req.set_rcvtimeo(10_000).unwrap();
        req.set_linger(0).unwrap();
        req.connect(&endpoint).unwrap();
        let mut replies = Vec::new();
        for i in 0..3u8 {
            req.send_multipart([&b"header"[..], &[i]], 0).unwrap();
            replies.push(req.recv_multipart(0).unwrap());
        }
        replies
    })
    .await
    .unwrap();
    for (i, r) in reply.iter().enumerate() {
        assert_eq!(r, &vec![b"re".to_vec(), b"header".to_vec(), vec![i as u8]]);
    }
}

#[tokio::test]
async fn a_long_frame_header_claiming_32_gib_drops_only_that_connection() {
    let limits = TransportLimits::default();
    let router = Router::loopback(&limits).await;
    let endpoint = router.endpoint().to_string();
    let stats = spawn_echo(router);
    let port = tcp_port(&endpoint);
    let rss_before = rss_kib();
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        zmtp_handshake(&mut s);
        // flags LONG, then a 64-bit size of 32 GiB: 9 bytes.
        let mut header = vec![0x02u8];
        header.extend_from_slice(&(32u64 << 30).to_be_bytes());
        s.write_all(&header).unwrap();
        closed_by_server(&mut s, Duration::from_secs(5))
    })
    .await
    .unwrap();
    assert!(closed, "the connection was not dropped");
    assert!(rss_kib() < rss_before + 100 * 1024, "RSS jumped");
    // Other clients are still served.
    let reply = round_trip(&endpoint, &limits, &Security::None).await;
    assert_eq!(reply[0], b(b"re"));
    eventually(&stats, |s| s.disconnects >= 1).await;
}

#[tokio::test]
async fn an_endless_multipart_message_is_bounded_by_max_message_bytes() {
    let limits = TransportLimits {
        max_message_bytes: 1 << 20,
        ..TransportLimits::default()
    };
    let endpoint = echo_server(&limits).await;
    let port = tcp_port(&endpoint);
    let rss_before = rss_kib();
    let (closed, sent) = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        zmtp_handshake(&mut s);
        // 1-byte frames with MORE set, forever: each is within every
        // per-frame limit and the message never completes. Unpatched libzmq
        // queues them all (~64 bytes of memory per 3 bytes sent).
        let chunk: Vec<u8> = std::iter::repeat_n([0x01u8, 1, b'x'], 1 << 16)
            .flatten()
            .collect();
        let mut sent = 0usize;
        let start = Instant::now();
        while sent < (32 << 20) && start.elapsed() < Duration::from_secs(10) {
            if s.write_all(&chunk).is_err() {
                return (true, sent);
            }
            sent += chunk.len();
        }
        (closed_by_server(&mut s, Duration::from_secs(5)), sent)
    })
    .await
    .unwrap();
    assert!(closed, "not dropped after {sent} bytes");
    // 1 MiB / (1 + 64) bytes per frame: dropped after ~16k frames (~50 KB sent).
    assert!(sent < (8 << 20), "dropped only after {sent} bytes");
    assert!(rss_kib() < rss_before + 100 * 1024, "RSS jumped");
    let reply = round_trip(&endpoint, &limits, &Security::None).await;
    assert_eq!(reply[0], b(b"re"));
}

#[tokio::test]
async fn frames_and_messages_over_the_limits_are_refused() {
    let limits = TransportLimits {
        max_message_bytes: 1 << 20,
        max_frame_bytes: 1000,
        max_frames: 4,
        ..TransportLimits::default()
    };
    let router = Router::loopback(&limits).await;
    let endpoint = router.endpoint().to_string();
    let stats = spawn_echo(router);
    let (mut rx, tx) = connect(&endpoint, &TransportLimits::default()).await;
    // A frame over max_frame_bytes: rejected, answered by the application.
    tx.send(vec![b(b"h"), Bytes::from(vec![0u8; 1001])])
        .unwrap();
    let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames[0], b(b"rejected"));
    // Too many frames: rejected.
    tx.send(vec![b(b"1"), b(b"2"), b(b"3"), b(b"4"), b(b"5")])
        .unwrap();
    let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames[0], b(b"rejected"));
    // Within the limits: served.
    tx.send(vec![b(b"1"), Bytes::from(vec![0u8; 1000])])
        .unwrap();
    let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames[0], b(b"re"));
    assert_eq!(stats.snapshot().rejected_messages, 2);
    // Over max_message_bytes: the connection is dropped before the body is
    // read; nothing comes back.
    let before = stats.snapshot().disconnects;
    tx.send(vec![Bytes::from(vec![0u8; 2 << 20])]).unwrap();
    assert!(timeout(Duration::from_millis(500), rx.recv())
        .await
        .is_err());
    eventually(&stats, |s| s.disconnects > before).await;
}

#[tokio::test]
async fn a_half_open_connection_is_closed_after_the_handshake_timeout() {
    let limits = TransportLimits {
        handshake_timeout: Duration::from_millis(300),
        ..TransportLimits::default()
    };
    let router = Router::loopback(&limits).await;
    let port = tcp_port(router.endpoint());
    let stats = spawn_echo(router);
    let (closed, after) = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let start = Instant::now();
        // Send nothing at all: no greeting.
        let closed = closed_by_server(&mut s, Duration::from_secs(5));
        (closed, start.elapsed())
    })
    .await
    .unwrap();
    assert!(closed);
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}"
    );
    assert!(after < Duration::from_secs(3), "closed after {after:?}");
    let s = eventually(&stats, |s| s.handshake_failures >= 1).await;
    assert_eq!(s.connections_accepted, 1, "{s:?}");
    assert_eq!(s.handshake_failures, 1, "{s:?}");
    assert_eq!(s.connections_established, 0, "{s:?}");
}

#[tokio::test]
async fn replies_to_a_peer_that_never_reads_are_dropped_and_counted_without_delaying_others() {
    let limits = TransportLimits {
        send_hwm: 8,
        ..TransportLimits::default()
    };
    let (endpoint, stats, mut rx, tx) = tcp_router_split(&limits).await;
    // The slow peer: a libzmq DEALER that sends once and never reads.
    let slow_endpoint = endpoint.clone();
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let slow = std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let d = ctx.socket(zmq::DEALER).unwrap();
        d.set_rcvhwm(1).unwrap();
        d.set_rcvbuf(4096).unwrap();
        d.set_linger(0).unwrap();
        d.connect(&slow_endpoint).unwrap();
        d.send("slow", 0).unwrap();
        let _ = hold_rx.recv_timeout(Duration::from_secs(30));
    });
    let slow_peer = timeout(WAIT, rx.recv()).await.unwrap().unwrap().peer;
    let reply = Bytes::from(vec![0u8; 64 << 10]);
    for _ in 0..2000 {
        tx.send(&slow_peer, vec![reply.clone()]).unwrap();
    }
    // Another peer is answered at once.
    let (mut frx, ftx) = connect(&endpoint, &limits).await;
    ftx.send(vec![b(b"fast")]).unwrap();
    let fast = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
    let start = Instant::now();
    tx.send(&fast.peer, vec![b(b"answer")]).unwrap();
    let m = timeout(WAIT, frx.recv()).await.unwrap().unwrap();
    assert_eq!(m.frames, vec![b(b"answer")]);
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    let s = stats.snapshot();
    assert!(s.dropped_sends > 1000, "{s:?}");
    assert_eq!(s.dropped_sends + s.messages_sent, 2001, "{s:?}");
    hold_tx.send(()).unwrap();
    slow.join().unwrap();
}

#[tokio::test]
async fn curve_lets_allowed_clients_in_and_refuses_the_others() {
    let server = CurveKeyPair::generate().unwrap();
    let good = CurveKeyPair::generate().unwrap();
    let bad = CurveKeyPair::generate().unwrap();
    assert_eq!(CurveKeyPair::from_secret(good.secret).unwrap(), good);
    assert_eq!(z85_decode(&z85_encode(&good.public)).unwrap(), good.public);
    let limits = TransportLimits::default();
    let security = Security::CurveServer {
        keys: server.clone(),
        allowed_clients: vec![good.public],
    };
    let router = Router::bind("tcp://127.0.0.1:0", &limits, &security)
        .await
        .unwrap();
    let endpoint = router.endpoint().to_string();
    let stats = spawn_echo(router);
    let client = |keys: CurveKeyPair| Security::CurveClient {
        server_public: server.public,
        keys,
    };
    let reply = round_trip(&endpoint, &limits, &client(good.clone())).await;
    assert_eq!(reply[0], b(b"re"));

    // A key that is not on the list: the handshake fails, nothing gets through.
    let (mut rx, tx) = Dealer::connect(&endpoint, &limits, &client(bad))
        .await
        .unwrap()
        .split();
    tx.send(vec![b(b"let me in")]).unwrap();
    assert!(timeout(Duration::from_millis(700), rx.recv())
        .await
        .is_err());
    // A client without CURVE at all.
    let (mut rx, tx) = connect(&endpoint, &limits).await;
    tx.send(vec![b(b"let me in")]).unwrap();
    assert!(timeout(Duration::from_millis(700), rx.recv())
        .await
        .is_err());
    // Monitor events arrive asynchronously; give them a moment under load.
    // The plain client's mechanism mismatch is a protocol failure when the
    // server sees it first, a handshake failure (peer closed) otherwise.
    let s = eventually(&stats, |s| {
        s.auth_failures >= 1 && s.protocol_failures + s.handshake_failures >= 1
    })
    .await;
    assert_eq!(s.messages_received, 1, "{s:?}");
}

/// Waits (up to 5 s) for the counters to satisfy `ok`; returns the last snapshot.
async fn eventually(stats: &TransportStats, ok: impl Fn(&StatsSnapshot) -> bool) -> StatsSnapshot {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = stats.snapshot();
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "counters never got there: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn max_buffered_bytes_pauses_reading_until_permits_are_released() {
    let limits = TransportLimits {
        max_buffered_bytes: 10_000,
        ..TransportLimits::default()
    };
    let (endpoint, stats, mut rx, _tx) = tcp_router_split(&limits).await;
    let (_crx, ctx) = connect(&endpoint, &limits).await;
    for _ in 0..10 {
        ctx.send(vec![Bytes::from(vec![0u8; 4000])]).unwrap();
    }
    // 3 messages (12,000 bytes) cross the bound; the rest wait in libzmq.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(timeout(WAIT, rx.recv()).await.unwrap().unwrap());
    }
    assert!(timeout(Duration::from_millis(300), rx.recv())
        .await
        .is_err());
    assert_eq!(stats.snapshot().reads_paused, 1);
    drop(held);
    for _ in 0..7 {
        let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
        assert_eq!(m.permit.bytes(), 4000);
    }
}

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn count_threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// A small runtime of the test's own, for the tests that count the
/// process's fds and threads (its threads are there before they count).
fn own_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .unwrap()
}

// Alone in its own runtime and counted against the whole process, so it
// tolerates what concurrently running tests open; a leak of even one fd per
// socket would show as hundreds.
#[test]
fn opening_and_closing_a_thousand_sockets_leaks_no_fds_or_threads() {
    let rt = own_runtime();
    rt.block_on(async {
        let limits = TransportLimits::default();
        // Warm up the runtime's own threads.
        drop(Router::loopback(&limits).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let fds_before = count_fds();
        let threads_before = count_threads();
        for i in 0..1000 {
            if i % 2 == 0 {
                let router = Router::loopback(&limits).await;
                let (rx, tx) = router.split();
                drop(tx);
                drop(rx);
            } else {
                let dealer = Dealer::connect("tcp://127.0.0.1:9", &limits, &Security::None)
                    .await
                    .unwrap();
                drop(dealer);
            }
        }
        // Contexts terminate on the blocking pool; give them a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while (count_fds() > fds_before + 20 || count_threads() > threads_before + 8)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (fds, threads) = (count_fds(), count_threads());
        assert!(fds <= fds_before + 20, "fds {fds_before} -> {fds}");
        assert!(
            threads <= threads_before + 8,
            "threads {threads_before} -> {threads}"
        );
    });
}

/// The host-path benchmark of docs/transport.md, through this module: a
/// ROUTER echo server that hands each message to a tokio task, which replies
/// (150 B header + 1,536 B payload) to a request of 120 B + 60 B. Client and
/// server share one tokio runtime. Run with
/// `cargo test --lib transport::tests::host_path_benchmark -- --ignored --nocapture`.
#[test]
#[ignore]
fn host_path_benchmark() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // REPLAYD_BENCH_SERVE=endpoint: only serve it (for a client in another
    // process), for REPLAYD_BENCH_SECS seconds.
    if let Ok(endpoint) = std::env::var("REPLAYD_BENCH_SERVE") {
        let secs: u64 = std::env::var("REPLAYD_BENCH_SECS").map_or(60, |s| s.parse().unwrap());
        // REPLAYD_BENCH_CURVE_SECRET=<Z85> and REPLAYD_BENCH_CURVE_ALLOW=<Z85>,…
        // serve with CURVE (to try pyzmq clients against it).
        let security = match std::env::var("REPLAYD_BENCH_CURVE_SECRET") {
            Ok(secret) => Security::CurveServer {
                keys: CurveKeyPair::from_secret(z85_decode(&secret).unwrap()).unwrap(),
                allowed_clients: std::env::var("REPLAYD_BENCH_CURVE_ALLOW")
                    .unwrap_or_default()
                    .split(',')
                    .filter(|k| !k.is_empty())
                    .map(|k| z85_decode(k).unwrap())
                    .collect(),
            },
            Err(_) => Security::None,
        };
        rt.block_on(async {
            let router = Router::bind(&endpoint, &TransportLimits::default(), &security)
                .await
                .unwrap();
            serve_bench(router);
            tokio::time::sleep(Duration::from_secs(secs)).await;
        });
        return;
    }
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ipc = format!("ipc://{}/bench.sock", dir.path().display());
        // REPLAYD_BENCH_CONNECT=endpoint: only the client side, against a
        // server in another process.
        let external = std::env::var("REPLAYD_BENCH_CONNECT").ok();
        let endpoints = match &external {
            Some(e) => vec![e.as_str()],
            None => vec!["tcp://127.0.0.1:0", ipc.as_str()],
        };
        for endpoint in endpoints {
            let limits = TransportLimits::default();
            let endpoint = if external.is_some() {
                endpoint.to_string()
            } else {
                let router = Router::bind(endpoint, &limits, &Security::None)
                    .await
                    .unwrap();
                let endpoint = router.endpoint().to_string();
                serve_bench(router);
                endpoint
            };
            let request = || vec![Bytes::from(vec![b'r'; 120]), Bytes::from(vec![b'a'; 60])];
            // Latency: one request at a time.
            let (mut crx, ctx) = connect(&endpoint, &limits).await;
            let mut lat = Vec::with_capacity(20_000);
            for i in 0..22_000 {
                let t = Instant::now();
                ctx.send(request()).unwrap();
                let m = crx.recv().await.unwrap();
                assert_eq!(m.frames[1].len(), 1536);
                if i >= 2_000 {
                    lat.push(t.elapsed().as_nanos() as u64);
                }
            }
            lat.sort_unstable();
            let q = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
            println!(
                "{endpoint}: latency p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
                q(0.5),
                q(0.9),
                q(0.99)
            );
            // Throughput: 8 sockets, 32 requests in flight each.
            let stop = Instant::now() + Duration::from_secs(6);
            let count_from = Instant::now() + Duration::from_secs(1);
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let (mut crx, ctx) = connect(&endpoint, &limits).await;
                tasks.push(tokio::spawn(async move {
                    for _ in 0..32 {
                        ctx.send(request()).unwrap();
                    }
                    let mut n = 0u64;
                    while Instant::now() < stop {
                        let m = crx.recv().await.unwrap();
                        assert_eq!(m.frames[1].len(), 1536);
                        if Instant::now() > count_from {
                            n += 1;
                        }
                        ctx.send(request()).unwrap();
                    }
                    n
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.unwrap();
            }
            println!(
                "{endpoint}: throughput {:.0} messages/s",
                total as f64 / 5.0
            );
        }
    });
}

/// The benchmark's server: each message to its own task, which replies.
fn serve_bench(router: Router) {
    let (mut rx, tx) = router.split();
    tokio::spawn(async move {
        while let Ok(m) = rx.recv().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                // A REQ peer's delimiter goes back in front of the reply.
                let req = m.frames.first().is_some_and(|f| f.is_empty());
                let mut header = m.frames[usize::from(req)].to_vec();
                header.resize(150, b'h');
                let mut reply = Vec::with_capacity(3);
                if req {
                    reply.push(Bytes::new());
                }
                reply.extend([Bytes::from(header), Bytes::from(vec![7u8; 1536])]);
                let _ = tx.send(&m.peer, reply);
            });
        }
    });
}

#[tokio::test]
async fn a_dealer_dropped_with_messages_waiting_for_a_peer_closes_and_counts_them() {
    // The daemon's end of a worker link whose worker died: what waited for
    // it is given up once both halves are dropped, and the socket closes (a
    // driver that kept waiting leaked one socket per restart).
    let limits = TransportLimits::default();
    let dealer = Dealer::bind("tcp://127.0.0.1:0", &limits, &Security::None)
        .await
        .unwrap();
    let endpoint = dealer.endpoint().to_string();
    let (rx, tx) = dealer.split();
    let stats = tx.stats();
    for _ in 0..3 {
        tx.send(vec![b(b"batch")]).unwrap();
    }
    drop((rx, tx));
    let s = eventually(&stats, |s| s.dropped_sends == 3).await;
    assert_eq!(s.messages_sent, 0, "{s:?}");
    // The port is free again only if the socket was closed.
    let deadline = Instant::now() + WAIT;
    while Dealer::bind(&endpoint, &limits, &Security::None)
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "{endpoint} never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn shards_of_one_tcp_endpoint_spread_connections_and_answer_on_each() {
    let limits = TransportLimits::default();
    let routers = Router::bind_shards("tcp://127.0.0.1:0", 4, &limits, &Security::None)
        .await
        .unwrap();
    assert_eq!(routers.len(), 4);
    let endpoint = routers[0].endpoint().to_string();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    assert_ne!(tcp_port(&endpoint), 0);
    assert!(routers.iter().all(|r| r.endpoint() == endpoint));
    let stats: Vec<_> = routers.into_iter().map(spawn_echo).collect();
    let mut peers = Vec::new();
    for i in 0..16u32 {
        let (rx, tx) = connect(&endpoint, &limits).await;
        tx.send(vec![Bytes::from(i.to_string())]).unwrap();
        peers.push((i, rx, tx));
    }
    for (i, mut rx, _tx) in peers {
        let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
        assert_eq!(m.frames, vec![b(b"re"), Bytes::from(i.to_string())]);
    }
    let per_shard: Vec<u64> = stats
        .iter()
        .map(|s| s.snapshot().messages_received)
        .collect();
    assert_eq!(per_shard.iter().sum::<u64>(), 16, "{per_shard:?}");
    assert!(
        per_shard.iter().filter(|&&n| n > 0).count() > 1,
        "every connection on one shard: {per_shard:?}"
    );
}

#[tokio::test]
async fn one_shard_or_ipc_is_one_plain_router() {
    let limits = TransportLimits::default();
    let one = Router::bind_shards("tcp://127.0.0.1:0", 1, &limits, &Security::None)
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    let dir = tempfile::tempdir().unwrap();
    let ipc = format!("ipc://{}/t.sock", dir.path().display());
    let routers = Router::bind_shards(&ipc, 4, &limits, &Security::None)
        .await
        .unwrap();
    assert_eq!(routers.len(), 1);
    assert_eq!(routers[0].endpoint(), ipc);
    spawn_echo(routers.into_iter().next().unwrap());
    let reply = round_trip(&ipc, &limits, &Security::None).await;
    assert_eq!(reply, vec![b(b"re"), b(b"header"), b(b"payload")]);
}

/// libzmq takes each shard's listening descriptor (ZMQ_USE_FD) and closes it
/// with the socket: binding and dropping sharded endpoints leaks nothing,
/// and a fixed port is free again once its shards are gone.
#[test]
fn sharded_listeners_are_closed_with_their_sockets() {
    let rt = own_runtime();
    rt.block_on(async {
        let limits = TransportLimits::default();
        let first = Router::bind_shards("tcp://127.0.0.1:0", 4, &limits, &Security::None)
            .await
            .unwrap();
        let endpoint = first[0].endpoint().to_string();
        // Held: the port is refused to a second group and to a plain bind.
        let again = Router::bind_shards(&endpoint, 4, &limits, &Security::None).await;
        assert!(again.is_err());
        assert!(Router::bind(&endpoint, &limits, &Security::None)
            .await
            .is_err());
        drop(first);
        let deadline = Instant::now() + Duration::from_secs(10);
        let rebound = loop {
            match Router::bind_shards(&endpoint, 4, &limits, &Security::None).await {
                Ok(r) => break r,
                Err(e) => {
                    assert!(Instant::now() < deadline, "{endpoint} not released: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        assert_eq!(rebound.len(), 4);
        drop(rebound);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let fds_before = count_fds();
        for _ in 0..100 {
            let routers = Router::bind_shards("tcp://127.0.0.1:0", 4, &limits, &Security::None)
                .await
                .unwrap();
            drop(routers);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while count_fds() > fds_before + 20 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let fds = count_fds();
        assert!(fds <= fds_before + 20, "fds {fds_before} -> {fds}");
    });
}

/// Messages that arrived before their connection closed are handed over
/// before the disconnect is counted, even while the receiver is full and
/// slow to read: whoever sees the disconnect already has every message that
/// came before it in the inbox, and `messages_received` counts them.
#[tokio::test]
async fn messages_before_a_disconnect_are_delivered_before_it_is_counted() {
    use futures::FutureExt;
    const N: u8 = 64;
    let (endpoint, _, mut server_rx, server_tx) =
        tcp_router_split(&TransportLimits::default()).await;
    // Room for 4 messages: the rest stay in libzmq until the test reads.
    let limits = TransportLimits {
        queue_messages: 4,
        ..TransportLimits::default()
    };
    let dealer = Dealer::connect(&endpoint, &limits, &Security::None)
        .await
        .unwrap();
    let stats = dealer.stats();
    let (mut rx, tx) = dealer.split();
    for i in 0..N {
        tx.send(vec![b(&[i])]).unwrap();
    }
    // The peer answers everything, then closes (lingering, as the daemon
    // does when it exits).
    for _ in 0..N {
        let m = timeout(WAIT, server_rx.recv()).await.unwrap().unwrap();
        server_tx.send(&m.peer, m.frames).unwrap();
    }
    drop((server_rx, server_tx));
    // Nothing read yet: give the close time to reach this side, where it
    // must not be counted while replies wait behind the full inbox.
    let end = Instant::now() + Duration::from_millis(250);
    while stats.snapshot().disconnects == 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut got = Vec::new();
    while got.len() < usize::from(N) {
        let s = stats.snapshot();
        let m = if s.disconnects > 0 {
            assert_eq!(s.messages_received, u64::from(N), "{s:?}");
            // Counted after the last reply was handed over: no waiting.
            rx.recv().now_or_never().unwrap_or_else(|| {
                panic!("disconnect counted with replies undelivered after {got:?}: {s:?}")
            })
        } else {
            timeout(WAIT, rx.recv()).await.unwrap()
        };
        got.push(m.unwrap().frames[0][0]);
    }
    assert_eq!(got, (0..N).collect::<Vec<_>>());
    let s = eventually(&stats, |s| s.disconnects == 1).await;
    assert_eq!(s.messages_received, u64::from(N), "{s:?}");
}
