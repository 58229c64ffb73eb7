//! The `/metrics` endpoint: a tiny axum app that renders a [`Registry`].
//!
//! Workers have no HTTP server of their own, so each process that serves
//! metrics binds its own listener (`--metrics-addr`); [`routes`] lets a
//! process that already runs axum mount the same endpoint.

use std::future::Future;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::{Registry, CONTENT_TYPE as METRICS_CONTENT_TYPE};

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

/// Serves `/metrics` on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, routes(registry))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn serves_the_registry_as_prometheus_text() {
        let registry = Registry::new();
        registry.counter("t_hits_total", "Hits.").add(7);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, registry, async {
            let _ = stopped.await;
        }));
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut body = String::new();
        s.read_to_string(&mut body).await.expect("read");
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.contains("text/plain; version=0.0.4"), "{body}");
        assert!(body.contains("t_hits_total 7\n"), "{body}");
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }
}
