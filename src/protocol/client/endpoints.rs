//! The state every part of a [`Client`](super::Client) shares, one entry
//! per endpoint: its socket, whether it is connected, suspect or draining,
//! and which sends are outstanding on it.
//!
//! Calls register their sends here ([`Shared::send`]) and hear what became
//! of each as an [`Outcome`]: the reply (the reader task of each endpoint
//! matches replies to sends by wire id), a loss with the connection, or
//! silence past the liveness timeout. The monitor task's [`Shared::tick`]
//! reads libzmq's connection events and the endpoints' silence; a
//! disconnect fails the endpoint's sends only once the reader has read
//! every reply that came before it. [`Shared::pick`] chooses the endpoint
//! of the next send.

use crate::protocol::{decode_reply, ReplyData, ReplyHeader};
use crate::transport::{Dealer, DealerReceiver, DealerSender, TransportStats};
use bytes::Bytes;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// One endpoint's state, as [`Client::stats`](super::Client::stats) reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointStats {
    pub endpoint: String,
    pub connected: bool,
    pub suspect: bool,
    pub draining: bool,
    pub in_flight: usize,
    pub peak_in_flight: usize,
    pub sent: u64,
    pub replies: u64,
    /// Sends lost with a connection.
    pub lost: u64,
    /// Sends that were re-sends (after a loss, `unavailable`, `overloaded` or silence).
    pub resent: u64,
    pub overloaded: u64,
    pub unavailable: u64,
    pub connects: u64,
    pub disconnects: u64,
}

/// What happened to one send, told to the call that made it.
pub(super) enum Outcome {
    Reply {
        wire: u64,
        ep: usize,
        /// Boxed: a reply header is large, and most outcomes are small.
        reply: Box<Decoded>,
    },
    Lost {
        wire: u64,
        ep: usize,
    },
    Suspect {
        ep: usize,
    },
}

/// A reply as the call gets it.
pub(super) enum Decoded {
    Reply(Box<ReplyHeader>, Option<ReplyData>),
    UnknownCode { code: String, message: String },
    Malformed(String),
}

/// An outstanding send: whom to tell what became of it.
struct SendSlot {
    call: mpsc::UnboundedSender<Outcome>,
    ep: usize,
    /// The endpoint's disconnects seen when it was sent: a later disconnect
    /// loses it, an earlier one does not.
    epoch: u64,
}

/// A disconnect whose sends are failed once the reader has caught up.
#[derive(Clone, Copy)]
struct PendingLoss {
    /// The transport's `messages_received` when the disconnect was seen: every
    /// reply that arrived before it is among these.
    watermark: u64,
    /// Sends made before this many disconnects were seen are lost.
    epoch: u64,
}

/// One endpoint's connection, liveness and counters.
struct EpState {
    connected: bool,
    seen_established: u64,
    seen_disconnects: u64,
    /// Messages the reader has taken from the transport (replies and
    /// rejected ones), to compare with a [`PendingLoss`]'s watermark.
    processed: u64,
    pending_loss: Option<PendingLoss>,
    /// Set when the endpoint has been silent too long with work outstanding.
    suspect: bool,
    draining_until: Option<Instant>,
    /// Since when the endpoint owes a reply without having sent one.
    quiet_since: Instant,
    stats: EndpointStats,
}

impl EpState {
    /// The epoch to lose sends before, once the reader has read every reply
    /// that arrived before the pending disconnect.
    fn due_loss(&mut self) -> Option<u64> {
        let loss = self.pending_loss?;
        if self.processed < loss.watermark {
            return None;
        }
        self.pending_loss = None;
        Some(loss.epoch)
    }
}

/// What the lock guards: the outstanding sends and the endpoints' state.
struct State {
    sends: HashMap<u64, SendSlot>,
    eps: Vec<EpState>,
    round_robin: usize,
}

/// One endpoint's socket (its sending half; a reader task owns the other).
struct Endpoint {
    address: String,
    send: DealerSender,
    transport: Arc<TransportStats>,
}

/// The endpoints, shared by the client's calls, its reader tasks and its
/// monitor task.
pub(super) struct Shared {
    endpoints: Vec<Endpoint>,
    state: Mutex<State>,
    /// Silence after which an endpoint with requests outstanding is suspect.
    liveness_timeout: Duration,
    /// How long an endpoint that answered `unavailable` gets no new requests.
    unavailable_backoff: Duration,
    /// Any endpoint connected, recovered or stopped draining.
    pub(super) changed: Notify,
    next_wire: AtomicU64,
    stray: AtomicU64,
}

/// Which endpoint a send may go to.
pub(super) enum Pick {
    Go(usize),
    /// None is usable now; try again by then (or when `changed` fires).
    WaitUntil(Option<Instant>),
}

impl Shared {
    /// The state of `sockets` (address, socket, connecting in the
    /// background), none of them seen connected yet; the sockets' receiving halves come back, in order,
    /// for the reader tasks.
    pub(super) fn new(
        sockets: Vec<(String, Dealer)>,
        liveness_timeout: Duration,
        unavailable_backoff: Duration,
    ) -> (Shared, Vec<DealerReceiver>) {
        let now = Instant::now();
        let mut endpoints = Vec::new();
        let mut eps = Vec::new();
        let mut receivers = Vec::new();
        for (address, socket) in sockets {
            let transport = socket.stats();
            let (recv, send) = socket.split();
            eps.push(EpState {
                connected: false,
                seen_established: 0,
                seen_disconnects: 0,
                processed: 0,
                pending_loss: None,
                suspect: false,
                draining_until: None,
                quiet_since: now,
                stats: EndpointStats {
                    endpoint: address.clone(),
                    ..Default::default()
                },
            });
            endpoints.push(Endpoint {
                address,
                send,
                transport,
            });
            receivers.push(recv);
        }
        let shared = Shared {
            endpoints,
            state: Mutex::new(State {
                sends: HashMap::new(),
                eps,
                round_robin: 0,
            }),
            liveness_timeout,
            unavailable_backoff,
            changed: Notify::new(),
            next_wire: AtomicU64::new(1),
            stray: AtomicU64::new(0),
        };
        (shared, receivers)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The healthy endpoint with the fewest requests outstanding, avoiding
    /// `avoid` when another is usable.
    pub(super) fn pick(&self, avoid: &HashSet<usize>) -> (Pick, bool) {
        let now = Instant::now();
        let mut st = self.lock();
        let any_connected = st.eps.iter().any(|e| e.connected);
        let usable = |e: &EpState, suspect_ok: bool| {
            e.connected && (suspect_ok || !e.suspect) && e.draining_until.is_none_or(|t| t <= now)
        };
        let n = st.eps.len();
        let start = st.round_robin;
        let mut best: Option<(usize, (bool, usize))> = None;
        for pass in [false, true] {
            for k in 0..n {
                let i = (start + k) % n;
                let e = &st.eps[i];
                if !usable(e, pass) {
                    continue;
                }
                let key = (avoid.contains(&i), e.stats.in_flight);
                if best.is_none_or(|(_, b)| key < b) {
                    best = Some((i, key));
                }
            }
            if best.is_some() {
                break;
            }
        }
        if let Some((i, _)) = best {
            st.round_robin = (i + 1) % n.max(1);
            return (Pick::Go(i), any_connected);
        }
        let wake = st
            .eps
            .iter()
            .filter(|e| e.connected)
            .filter_map(|e| e.draining_until)
            .min();
        (Pick::WaitUntil(wake), any_connected)
    }

    /// Whether some endpoint (`every`: each of them) is connected.
    pub(super) fn connected(&self, every: bool) -> bool {
        let st = self.lock();
        if every {
            st.eps.iter().all(|e| e.connected)
        } else {
            st.eps.iter().any(|e| e.connected)
        }
    }

    /// Whether an endpoint other than `ep` is connected and not suspect.
    pub(super) fn other_healthy(&self, ep: usize) -> bool {
        self.lock()
            .eps
            .iter()
            .enumerate()
            .any(|(i, e)| i != ep && e.connected && !e.suspect)
    }

    /// The endpoints' addresses, as given.
    pub(super) fn addresses(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| e.address.clone()).collect()
    }

    pub(super) fn address(&self, ep: usize) -> String {
        self.endpoints[ep].address.clone()
    }

    /// Per endpoint: connection state and counters.
    pub(super) fn stats(&self) -> Vec<EndpointStats> {
        let now = Instant::now();
        self.lock()
            .eps
            .iter()
            .map(|e| EndpointStats {
                connected: e.connected,
                suspect: e.suspect,
                draining: e.draining_until.is_some_and(|t| t > now),
                ..e.stats.clone()
            })
            .collect()
    }

    /// A fresh wire id (unique on this client).
    pub(super) fn next_wire(&self) -> u64 {
        self.next_wire.fetch_add(1, Ordering::Relaxed)
    }

    /// Replies that matched no outstanding send.
    pub(super) fn stray_replies(&self) -> u64 {
        self.stray.load(Ordering::Relaxed)
    }

    /// Sends outstanding on every endpoint.
    pub(super) fn outstanding(&self) -> usize {
        self.lock().sends.len()
    }

    /// Registers and sends one message; false when the socket is closed.
    pub(super) fn send(
        &self,
        ep: usize,
        wire: u64,
        frames: Vec<Bytes>,
        call: &mpsc::UnboundedSender<Outcome>,
        resend: bool,
    ) -> bool {
        {
            let mut st = self.lock();
            let epoch = st.eps[ep].seen_disconnects;
            st.sends.insert(
                wire,
                SendSlot {
                    call: call.clone(),
                    ep,
                    epoch,
                },
            );
            let e = &mut st.eps[ep];
            if e.stats.in_flight == 0 {
                e.quiet_since = Instant::now();
            }
            e.stats.in_flight += 1;
            e.stats.peak_in_flight = e.stats.peak_in_flight.max(e.stats.in_flight);
            e.stats.sent += 1;
            e.stats.resent += u64::from(resend);
        }
        if self.endpoints[ep].send.send(frames).is_err() {
            self.forget(wire);
            return false;
        }
        true
    }

    /// Drops a send's registration (its reply, if any, will be stray).
    pub(super) fn forget(&self, wire: u64) {
        let mut st = self.lock();
        if let Some(slot) = st.sends.remove(&wire) {
            let e = &mut st.eps[slot.ep];
            e.stats.in_flight = e.stats.in_flight.saturating_sub(1);
        }
    }

    /// `ep` answered `unavailable`: no new requests for a while.
    pub(super) fn set_draining(&self, ep: usize) {
        let until = Instant::now() + self.unavailable_backoff;
        let mut st = self.lock();
        st.eps[ep].draining_until = Some(until);
        st.eps[ep].stats.unavailable += 1;
    }

    pub(super) fn count_overloaded(&self, ep: usize) {
        self.lock().eps[ep].stats.overloaded += 1;
    }

    /// A reply came from `ep`.
    fn on_reply(&self, ep: usize, frames: Vec<Bytes>) {
        let (wire, reply) = decode(&frames);
        let mut st = self.lock();
        let e = &mut st.eps[ep];
        e.processed += 1;
        let loss = e.due_loss();
        e.stats.replies += 1;
        e.quiet_since = Instant::now();
        let recovered = std::mem::replace(&mut e.suspect, false);
        let slot = wire.and_then(|w| st.sends.remove(&w));
        match slot {
            Some(slot) => {
                let e = &mut st.eps[slot.ep];
                e.stats.in_flight = e.stats.in_flight.saturating_sub(1);
                drop(st);
                let _ = slot.call.send(Outcome::Reply {
                    wire: wire.unwrap_or(0),
                    ep,
                    reply: Box::new(reply),
                });
            }
            None => {
                drop(st);
                self.stray.fetch_add(1, Ordering::Relaxed);
            }
        }
        if recovered {
            self.changed.notify_waiters();
        }
        if let Some(epoch) = loss {
            self.lose(ep, epoch);
        }
    }

    /// A message from `ep` was refused by the transport (it still counts as
    /// read, for a pending loss).
    fn on_rejected(&self, ep: usize) {
        let loss = {
            let mut st = self.lock();
            let e = &mut st.eps[ep];
            e.processed += 1;
            e.due_loss()
        };
        if let Some(epoch) = loss {
            self.lose(ep, epoch);
        }
    }

    /// Every send on `ep` is lost (its socket closed).
    fn lose_all(&self, ep: usize) {
        self.lose(ep, u64::MAX);
    }

    /// The sends on `ep` made before `epoch` disconnects were seen are lost.
    fn lose(&self, ep: usize, epoch: u64) {
        let mut lost = Vec::new();
        {
            let mut st = self.lock();
            let wires: Vec<u64> = st
                .sends
                .iter()
                .filter(|(_, s)| s.ep == ep && s.epoch < epoch)
                .map(|(w, _)| *w)
                .collect();
            for w in wires {
                if let Some(slot) = st.sends.remove(&w) {
                    lost.push((w, slot.call));
                }
            }
            let e = &mut st.eps[ep];
            e.stats.in_flight = e.stats.in_flight.saturating_sub(lost.len());
            e.stats.lost += lost.len() as u64;
            e.suspect = false;
        }
        for (wire, call) in lost {
            let _ = call.send(Outcome::Lost { wire, ep });
        }
    }

    /// One monitor tick: connection changes and liveness.
    pub(super) fn tick(&self) {
        let now = Instant::now();
        let mut lost_eps = Vec::new();
        let mut suspects: Vec<(usize, Vec<mpsc::UnboundedSender<Outcome>>)> = Vec::new();
        let mut changed = false;
        {
            let mut st = self.lock();
            for (i, ep) in self.endpoints.iter().enumerate() {
                let snap = ep.transport.snapshot();
                let e = &mut st.eps[i];
                let new_est = snap.connections_established - e.seen_established;
                let new_disc = snap.disconnects - e.seen_disconnects;
                e.seen_established = snap.connections_established;
                e.seen_disconnects = snap.disconnects;
                e.stats.connects += new_est;
                e.stats.disconnects += new_disc;
                if new_disc > 0 {
                    // Replies that came before the disconnect may still be
                    // on their way to the reader: the sends are lost once it
                    // has read up to here (at once if it already has).
                    e.pending_loss = Some(PendingLoss {
                        watermark: snap.messages_received,
                        epoch: e.seen_disconnects,
                    });
                }
                if let Some(epoch) = e.due_loss() {
                    lost_eps.push((i, epoch));
                }
                let connected = match (new_est > 0, new_disc > 0) {
                    (true, false) => true,
                    (false, true) => false,
                    (false, false) => e.connected,
                    (true, true) => snap.connections_established > snap.disconnects,
                };
                if connected && !e.connected {
                    changed = true;
                }
                e.connected = connected;
                if e.draining_until.is_some_and(|t| t <= now) {
                    e.draining_until = None;
                    changed = true;
                }
                if !e.suspect
                    && e.connected
                    && e.stats.in_flight > 0
                    && now.duration_since(e.quiet_since) >= self.liveness_timeout
                {
                    e.suspect = true;
                    suspects.push((i, Vec::new()));
                }
            }
            for (i, calls) in &mut suspects {
                calls.extend(
                    st.sends
                        .values()
                        .filter(|s| s.ep == *i)
                        .map(|s| s.call.clone()),
                );
            }
        }
        for (ep, epoch) in lost_eps {
            self.lose(ep, epoch);
        }
        for (ep, calls) in suspects {
            tracing::debug!(endpoint = %self.endpoints[ep].address, "replayd client: endpoint silent, suspect");
            for c in calls {
                let _ = c.send(Outcome::Suspect { ep });
            }
        }
        if changed {
            self.changed.notify_waiters();
        }
    }
}

/// The wire id and the decoded reply; a reply with an unknown error code or
/// an unreadable header is still matched when its id can be read.
fn decode(frames: &[Bytes]) -> (Option<u64>, Decoded) {
    match decode_reply(frames) {
        Ok((header, output)) => (Some(header.id), Decoded::Reply(Box::new(header), output)),
        Err(e) => {
            #[derive(serde::Deserialize)]
            struct Lax {
                id: u64,
                status: Option<String>,
                code: Option<String>,
                message: Option<String>,
            }
            match frames
                .first()
                .and_then(|h| rmp_serde::from_slice::<Lax>(h).ok())
            {
                Some(Lax {
                    id,
                    status: Some(s),
                    code: Some(code),
                    message,
                }) if s == "error" => (
                    Some(id),
                    Decoded::UnknownCode {
                        code,
                        message: message.unwrap_or_default(),
                    },
                ),
                Some(lax) => (Some(lax.id), Decoded::Malformed(e)),
                None => (None, Decoded::Malformed(e)),
            }
        }
    }
}

/// The reader task of endpoint `ep`: every message it receives, until its
/// socket closes; then every send on it is lost.
pub(super) async fn read_replies(shared: Arc<Shared>, ep: usize, mut recv: DealerReceiver) {
    loop {
        match recv.recv().await {
            Ok(msg) => shared.on_reply(ep, msg.frames),
            Err(crate::transport::TransportError::Rejected { .. }) => shared.on_rejected(ep),
            Err(_) => break,
        }
    }
    shared.lose_all(ep);
}
