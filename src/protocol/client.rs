//! A Rust client for the wire protocol (see `docs/protocol.md`).
//!
//! [`Client`] pipelines: any number of requests may be outstanding on one
//! connection; a background task matches replies to requests by id.
//! [`RawClient`] sends arbitrary frames and returns whatever comes back
//! (for protocol tests and tools).

use crate::protocol::{
    decode_reply, encode_request, InputKind, Payload, ReplyHeader, RequestHeader,
};
use crate::tensor::{DType, HostTensor};
use crate::transport::{Dealer, DealerReceiver, DealerSender, Security, TransportLimits};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::oneshot;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot connect to {endpoint}: {message}")]
    Connect { endpoint: String, message: String },
    #[error("socket error: {0}")]
    Socket(String),
    #[error("malformed reply: {0}")]
    Reply(String),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("the connection closed")]
    Closed,
}

/// A reply: its header and, on success, the output tensor.
#[derive(Clone, Debug)]
pub struct Response {
    pub header: ReplyHeader,
    pub output: Option<HostTensor>,
}

/// A client's socket limits: replies as large as the daemon may send.
pub fn client_limits() -> TransportLimits {
    TransportLimits {
        max_message_bytes: u32::MAX as usize,
        max_frame_bytes: 1 << 31,
        max_frames: 4,
        heartbeat: None,
        ..TransportLimits::default()
    }
}

async fn connect_dealer(endpoint: &str) -> Result<Dealer, ClientError> {
    Dealer::connect(endpoint, &client_limits(), &Security::None)
        .await
        .map_err(|e| ClientError::Connect {
            endpoint: endpoint.to_string(),
            message: e.to_string(),
        })
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

pub struct Client {
    send: DealerSender,
    waiters: Waiters,
    /// Replies whose id matched no outstanding request (duplicates, or
    /// replies after a timeout).
    stray: Arc<AtomicU64>,
    next_id: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Client {
    pub async fn connect(endpoint: &str) -> Result<Client, ClientError> {
        let socket = connect_dealer(endpoint).await?;
        let (mut recv, send) = socket.split();
        let waiters: Waiters = Arc::default();
        let w = waiters.clone();
        let stray = Arc::new(AtomicU64::new(0));
        let stray_count = stray.clone();
        let reader = tokio::spawn(async move {
            while let Ok(msg) = recv.recv().await {
                let frames = msg.frames;
                let Ok((header, output)) = decode_reply(&frames) else {
                    continue;
                };
                let waiter = w.lock().unwrap().remove(&header.id);
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(Response { header, output });
                    }
                    None => {
                        stray_count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            w.lock().unwrap().clear();
        });
        Ok(Client {
            send,
            waiters,
            stray,
            next_id: AtomicU64::new(1),
            reader,
        })
    }

    /// Replies received that matched no outstanding request.
    pub fn stray_replies(&self) -> u64 {
        self.stray.load(Ordering::Relaxed)
    }

    /// A fresh request id (unique on this client).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a request and waits for its reply. `header.id` must be unique
    /// among this client's outstanding requests (use [`Client::next_id`]).
    pub async fn request(
        &self,
        header: &RequestHeader,
        payload: &Payload,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().unwrap().insert(header.id, tx);
        let frames = encode_request(header, payload);
        if let Err(e) = self.send.send(frames) {
            self.waiters.lock().unwrap().remove(&header.id);
            return Err(ClientError::Socket(e.to_string()));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => {
                self.waiters.lock().unwrap().remove(&header.id);
                Err(ClientError::Timeout(timeout))
            }
        }
    }

    /// Runs an MLP-style model on f32 rows.
    pub async fn infer(
        &self,
        model: &str,
        input: &HostTensor,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let mut header = RequestHeader::new(self.next_id(), model, InputKind::Tensor);
        header.dtype = Some(input.dtype);
        header.shape = Some(input.shape.iter().map(|&d| d as u64).collect());
        self.request(&header, &Payload::Tensor(input.clone()), timeout)
            .await
    }

    /// Embeds texts with an encoder model.
    pub async fn embed(
        &self,
        model: &str,
        texts: &[&str],
        output_dtype: DType,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let mut header = RequestHeader::new(self.next_id(), model, InputKind::Texts);
        header.output_dtype = Some(output_dtype);
        let payload = Payload::Texts(texts.iter().map(|t| t.to_string()).collect());
        self.request(&header, &payload, timeout).await
    }
}

/// Sends raw frames and receives raw replies, one at a time.
pub struct RawClient {
    send: DealerSender,
    recv: DealerReceiver,
}

impl RawClient {
    pub async fn connect(endpoint: &str) -> Result<RawClient, ClientError> {
        let (recv, send) = connect_dealer(endpoint).await?.split();
        Ok(RawClient { send, recv })
    }

    pub async fn send(&mut self, frames: Vec<Bytes>) -> Result<(), ClientError> {
        self.send
            .send(frames)
            .map_err(|e| ClientError::Socket(e.to_string()))
    }

    pub async fn recv(&mut self, timeout: Duration) -> Result<Vec<Bytes>, ClientError> {
        match tokio::time::timeout(timeout, self.recv.recv()).await {
            Ok(Ok(m)) => Ok(m.frames),
            Ok(Err(e)) => Err(ClientError::Socket(e.to_string())),
            Err(_) => Err(ClientError::Timeout(timeout)),
        }
    }

    /// Receives and decodes one reply.
    pub async fn recv_reply(&mut self, timeout: Duration) -> Result<Response, ClientError> {
        let frames = self.recv(timeout).await?;
        let (header, output) = decode_reply(&frames).map_err(ClientError::Reply)?;
        Ok(Response { header, output })
    }
}
