//! The `[http]` section: the optional HTTP front (`src/daemon/http.rs`).

use super::{invalid, ConfigError};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Serve the HTTP front: `POST /v1/embeddings`, text-embeddings-inference's
    /// `POST /embed`, `/rerank`, `/tokenize` and `GET /info`, `GET /v1/models`
    /// and `GET /health` (off by default).
    pub enabled: bool,
    /// `HOST:PORT` to listen on; port 0 picks a free one (the ready file says which).
    pub listen: String,
    /// Listen on a non-loopback address (the HTTP front has no authentication).
    pub allow_remote: bool,
    /// Largest request body accepted, in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// Requests handled at once; more get 429 (`overloaded`) at once.
    pub max_concurrency: usize,
    /// Each request's deadline, in milliseconds (sent to the batcher as its
    /// `timeout_us`; past it the reply is 504 `deadline_exceeded`).
    pub request_timeout_ms: u64,
    /// The model used when a request names none (default: the first
    /// `kind = "bert"` model).
    pub default_model: Option<String>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: "127.0.0.1:8080".into(),
            allow_remote: false,
            max_body_bytes: 16 << 20,
            max_concurrency: 256,
            request_timeout_ms: 60_000,
            default_model: None,
        }
    }
}

impl HttpConfig {
    pub(super) fn validate(&self, models: &[super::ModelConfig]) -> Result<(), ConfigError> {
        let addr: std::net::SocketAddr = self.listen.parse().map_err(|_| {
            invalid(
                "http.listen",
                format!(
                    "{:?} is not HOST:PORT with an IP address (e.g. \"127.0.0.1:8080\")",
                    self.listen
                ),
            )
        })?;
        if !addr.ip().is_loopback() && !self.allow_remote {
            return Err(invalid(
                "http.listen",
                format!(
                    "{} accepts requests from other hosts and the HTTP front has no authentication; listen on a loopback address or set http.allow_remote = true",
                    self.listen
                ),
            ));
        }
        if !(1024..=1 << 30).contains(&self.max_body_bytes) {
            return Err(invalid(
                "http.max_body_bytes",
                "must be between 1024 and 1073741824",
            ));
        }
        if self.max_concurrency == 0 {
            return Err(invalid("http.max_concurrency", "must be at least 1"));
        }
        if self.request_timeout_ms == 0 {
            return Err(invalid("http.request_timeout_ms", "must be at least 1"));
        }
        if let Some(name) = &self.default_model {
            if !models.iter().any(|m| &m.name == name) {
                return Err(invalid(
                    "http.default_model",
                    format!("{name:?} is not a configured model"),
                ));
            }
        }
        Ok(())
    }
}
