//! The daemon's one HTTP server, axum, for both of its listeners: the
//! metrics listener (`metrics.endpoint`, loopback: [`super::prometheus::router`])
//! and the HTTP front (`http.listen`: [`super::http::router`]). Each is bound
//! at start-up, so a taken port stops the daemon before it serves, and served
//! until the daemon stops; requests being handled then finish.

use anyhow::Context;
use axum::Router;
use std::future::Future;
use std::net::SocketAddr;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Binds `address` (`HOST:PORT`; port 0 picks a free one); `key` names the
/// config key it came from in the error.
pub async fn bind(address: &str, key: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {key} {address}"))
}

/// Serves `routes` on `listener` until `shutdown` resolves, then waits for
/// the requests being handled; `what` names the listener in the log.
pub fn serve(
    listener: TcpListener,
    routes: Router,
    what: &'static str,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (Option<SocketAddr>, JoinHandle<()>) {
    let bound = listener.local_addr().ok();
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, routes)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!("{what}: {e}");
        }
    });
    (bound, task)
}
