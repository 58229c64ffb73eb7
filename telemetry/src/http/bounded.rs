//! An HTTP/1.1 listener with the bounds `axum::serve` leaves out.
//!
//! `axum::serve` sets no hyper timer, so hyper's header-read timeout never
//! runs: a client that sends half a request line (slowloris) or opens a
//! connection and says nothing holds a task and a socket for ever, and
//! nothing caps how many it may hold. Here each connection is served by
//! hyper's HTTP/1 builder with a timer and [`ConnectionLimits::header_timeout`]
//! (which also closes a keep-alive connection that sends no next request
//! within it), and at most [`ConnectionLimits::max_connections`] are open at
//! once: one past the cap is answered with the caller's [`Refusal`] (a 503)
//! and closed, so a client is told rather than left in the accept backlog.
//!
//! Shutdown stops accepting, then lets open requests finish, for at most
//! [`DRAIN_TIMEOUT`]. The OpenAI API and `/metrics` both serve through
//! [`serve`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// How long a client has to send a request's headers (and an idle
/// keep-alive connection to start its next request) by default: far more
/// than any client on a working network needs.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for open requests.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a refused connection gets to take its 503 (and to close).
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// The most of a refused client's request read before closing anyway.
const MAX_REFUSAL_DRAIN_BYTES: usize = 64 << 10;

/// Per-listener connection bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// What a connection past the cap is told (with status 503 and
/// `retry-after: 1`) before it is closed.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub content_type: &'static str,
    pub body: String,
}

impl Refusal {
    fn response(&self) -> Vec<u8> {
        format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {}\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{}",
            self.content_type,
            self.body.len(),
            self.body
        )
        .into_bytes()
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes.
pub async fn serve(
    app: axum::Router,
    listener: TcpListener,
    limits: ConnectionLimits,
    refusal: Refusal,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusal: Arc<[u8]> = refusal.response().into();
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(
                limit = limits.max_connections,
                "HTTP connection refused: the listener is at its cap"
            );
            tokio::spawn(refuse(stream, refusal.clone()));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout);
        let conn =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "HTTP requests still open after {DRAIN_TIMEOUT:?} of shutdown; dropping them"
        );
    }
    Ok(())
}

/// Writes the refusal to a connection past the cap and closes it.
///
/// The client's request is read (and dropped) until it closes its side or
/// the timeout: a socket closed with unread bytes sends a reset, which can
/// reach the client before it has read the 503 (or fail its write).
async fn refuse(mut stream: TcpStream, response: Arc<[u8]>) {
    let answered = async {
        stream.write_all(&response).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0usize;
        while drained < MAX_REFUSAL_DRAIN_BYTES {
            match stream.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, answered).await;
}
