//! Connecting to etcd and bounding every unary call.
//!
//! `etcd_client::Client::connect` is lazy: it builds a balanced channel and
//! returns without touching the network, and a request to an endpoint that
//! never answers can wait indefinitely for the balancer to find a ready
//! connection. So every unary call goes through [`call`], which bounds it by
//! [`REQUEST_TIMEOUT`] and names the endpoints and the operation in the
//! error. Streams (watch, lease keep-alive) are not bounded as a whole; their
//! users bound each step instead, and HTTP/2 keep-alive pings
//! ([`KEEPALIVE_INTERVAL`], [`KEEPALIVE_TIMEOUT`]) end a stream whose peer
//! has silently vanished. The pings respect etcd's keep-alive enforcement
//! (`--grpc-keepalive-min-time`, 5 s by default, and no pings on a
//! connection without streams): a client that pings more often is sent
//! `GOAWAY` ("too many pings") after three strikes, which broke every idle
//! watch about every 12 s.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::DiscoveryError;

/// The longest any single unary etcd call may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// TCP connect timeout per attempt.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// HTTP/2 ping interval on the etcd connection: above etcd's default
/// minimum of 5 s between a client's pings.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(6);

/// How long a ping may go unanswered before the connection is dropped.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The endpoints, joined for error messages.
pub(crate) fn shown(endpoints: &[String]) -> String {
    endpoints.join(",")
}

/// A client for `endpoints` (no network traffic yet; see the module doc).
pub(crate) async fn connect(endpoints: &[String]) -> Result<Client, DiscoveryError> {
    if endpoints.is_empty() {
        return Err(DiscoveryError::NoEndpoints);
    }
    let options = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT)
        .with_keep_alive_while_idle(false);
    let connecting = Client::connect(endpoints, Some(options));
    match tokio::time::timeout(REQUEST_TIMEOUT, connecting).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(
            source @ (etcd_client::Error::InvalidUri(_) | etcd_client::Error::InvalidArgs(_)),
        )) => Err(DiscoveryError::BadEndpoints {
            endpoints: shown(endpoints),
            source,
        }),
        Ok(Err(source)) => Err(DiscoveryError::Request {
            endpoints: shown(endpoints),
            what: "connecting",
            source,
        }),
        Err(_) => Err(DiscoveryError::Unreachable {
            endpoints: shown(endpoints),
            what: "connecting",
            after: REQUEST_TIMEOUT,
        }),
    }
}

/// Runs one etcd call under [`REQUEST_TIMEOUT`].
pub(crate) async fn call<T>(
    endpoints: &[String],
    what: &'static str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) if is_unavailable(&source) => Err(DiscoveryError::Unavailable {
            endpoints: shown(endpoints),
            what,
            source,
        }),
        Ok(Err(source)) => Err(DiscoveryError::Request {
            endpoints: shown(endpoints),
            what,
            source,
        }),
        Err(_) => Err(DiscoveryError::Unreachable {
            endpoints: shown(endpoints),
            what,
            after: REQUEST_TIMEOUT,
        }),
    }
}

/// A connection failure (refused, reset, unresolvable), as opposed to etcd
/// answering with an error.
fn is_unavailable(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => status.code() == tonic::Code::Unavailable,
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// Exponential backoff between retries: `first`, doubling up to `max`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The delay before the next retry; each call doubles the following one.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Back to `first` after a success.
    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let delays: Vec<_> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[tokio::test]
    async fn no_endpoints_is_an_error_that_says_what_to_pass() {
        let Err(err) = connect(&[]).await else {
            panic!("connecting to no endpoints succeeded");
        };
        assert!(err.to_string().contains("http://127.0.0.1:2379"), "{err}");
    }
}
