//! The `/metrics` endpoint: a tiny axum app that renders a [`Registry`].
//!
//! Workers have no HTTP server of their own, so each process that serves
//! metrics binds its own listener (`--metrics-addr`); [`routes`] lets a
//! process that already runs axum mount the same endpoint. The listener is
//! [`bounded`]: a scraper gets [`METRICS_LIMITS`] (a few connections, the
//! usual header timeout), so a port open to the network cannot be used to
//! hold sockets and tasks without bound.

pub mod bounded;

use std::future::Future;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::{Registry, CONTENT_TYPE as METRICS_CONTENT_TYPE};
pub use bounded::{ConnectionLimits, Refusal, DEFAULT_HEADER_TIMEOUT};

/// The `/metrics` listener's bounds: Prometheus scrapes over one or two
/// connections per scraper, so 64 leaves room for many scrapers and a
/// curious operator without letting a flood hold sockets.
pub const METRICS_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: 64,
    header_timeout: DEFAULT_HEADER_TIMEOUT,
};

/// `GET /metrics` over `registry`.
pub fn routes(registry: Registry) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move { ([(CONTENT_TYPE, METRICS_CONTENT_TYPE)], registry.render()).into_response() }
        }),
    )
}

/// Serves `/metrics` on `listener` within `limits` (normally
/// [`METRICS_LIMITS`]) until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let refusal = Refusal {
        content_type: "text/plain; charset=utf-8",
        body: format!(
            "this metrics endpoint has {} connections open, its limit; retry shortly\n",
            limits.max_connections
        ),
    };
    bounded::serve(routes(registry), listener, limits, refusal, shutdown).await
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Starts `/metrics` on a fresh port; dropping the sender stops it.
    async fn start(
        registry: Registry,
        limits: ConnectionLimits,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, registry, limits, async {
            let _ = stopped.await;
        }));
        (addr, stop, server)
    }

    /// Sends a GET and reads to the close; what came back and how long.
    async fn read_to_close(s: &mut TcpStream) -> (String, Duration) {
        let started = Instant::now();
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
        assert!(read.is_ok(), "the server kept the connection open for 10 s");
        (
            String::from_utf8_lossy(&got).into_owned(),
            started.elapsed(),
        )
    }

    async fn scrape(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        read_to_close(&mut s).await.0
    }

    #[tokio::test]
    async fn serves_the_registry_as_prometheus_text() {
        let registry = Registry::new();
        registry.counter("t_hits_total", "Hits.").add(7);
        let (addr, stop, server) = start(registry, METRICS_LIMITS).await;
        let body = scrape(addr).await;
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.contains("text/plain; version=0.0.4"), "{body}");
        assert!(body.contains("t_hits_total 7\n"), "{body}");
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }

    #[tokio::test]
    async fn silent_connections_are_closed_and_the_cap_answers_503() {
        let limits = ConnectionLimits {
            max_connections: 2,
            header_timeout: Duration::from_millis(300),
        };
        let (addr, stop, server) = start(Registry::new(), limits).await;
        let mut silent = Vec::new();
        for _ in 0..limits.max_connections {
            silent.push(TcpStream::connect(addr).await.expect("connect"));
        }
        // Let the server accept both before the one past the cap.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let refused = scrape(addr).await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(refused.contains("retry-after: 1"), "{refused}");
        for s in &mut silent {
            let (_, took) = read_to_close(s).await;
            assert!(
                took < Duration::from_secs(3),
                "a silent connection lived {took:?}"
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !scrape(addr).await.starts_with("HTTP/1.1 200") {
            assert!(Instant::now() < deadline, "the cap never freed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }
}
