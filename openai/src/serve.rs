//! The API's HTTP/1.1 listener: [`tandem_telemetry::http::bounded`] (header
//! timeout, connection cap) with the cap's 503 in OpenAI's error shape.

use std::future::Future;

use axum::http::StatusCode;
use tandem_telemetry::http::bounded::{self, ConnectionLimits, Refusal};
use tokio::net::TcpListener;

use crate::error::ApiError;

/// Open connections one listener serves at once by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// The API's default bounds.
pub const DEFAULT_LIMITS: ConnectionLimits = ConnectionLimits {
    max_connections: DEFAULT_MAX_CONNECTIONS,
    header_timeout: bounded::DEFAULT_HEADER_TIMEOUT,
};

/// Serves `app` on `listener` within `limits` until `shutdown` completes.
pub(crate) async fn serve(
    app: axum::Router,
    listener: TcpListener,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let error = ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!(
            "This server has {} connections open, its limit; retry shortly.",
            limits.max_connections
        ),
        param: None,
        code: Some("too_many_connections"),
        retry_after: Some(1),
    };
    let refusal = Refusal {
        content_type: "application/json",
        body: error.body().to_string(),
    };
    bounded::serve(app, listener, limits, refusal, shutdown).await
}
