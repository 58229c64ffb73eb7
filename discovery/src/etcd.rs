//! Connecting to etcd and bounding every unary call.
//!
//! [`connect`] builds an `etcd_client::Client` from an
//! [`EtcdConfig`](crate::EtcdConfig) (endpoints, TLS, user) after checking
//! it ([`EtcdConfig::check`](crate::EtcdConfig::check)).
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

use std::error::Error as _;
use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::{DiscoveryError, EtcdConfig};

/// The longest any single unary etcd call may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// TCP connect timeout per attempt.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// HTTP/2 ping interval on the etcd connection: above etcd's default
/// minimum of 5 s between a client's pings.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(6);

/// How long a ping may go unanswered before the connection is dropped.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// What to check when etcd cannot be reached, for error messages.
pub(crate) fn hint(config: &EtcdConfig) -> &'static str {
    if config.tls().is_some() {
        "is etcd running there, is the address right, and do the TLS settings match \
         etcd's: does the CA sign its certificate, for that host, and does etcd accept \
         the client certificate (or need one)?"
    } else {
        "is etcd running there, and is the address right?"
    }
}

/// A client for `config` (see the module doc). Without a user no network
/// traffic happens yet; with one, etcd-client authenticates here, so this
/// is where a wrong password (or an unreachable etcd) shows.
pub(crate) async fn connect(config: &EtcdConfig) -> Result<Client, DiscoveryError> {
    config.check()?;
    let options = config.connect_options(
        ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT)
            .with_keep_alive_while_idle(false),
    );
    let connecting = Client::connect(config.endpoints(), Some(options));
    match tokio::time::timeout(REQUEST_TIMEOUT, connecting).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(
            source @ (etcd_client::Error::InvalidUri(_) | etcd_client::Error::InvalidArgs(_)),
        )) => Err(DiscoveryError::BadEndpoints {
            endpoints: config.shown(),
            source,
        }),
        Ok(Err(source)) if is_unavailable(&source) => Err(DiscoveryError::Unavailable {
            endpoints: config.shown(),
            what: "connecting",
            source,
            hint: hint(config),
        }),
        Ok(Err(source @ etcd_client::Error::GRpcStatus(_))) if config.user().is_some() => {
            Err(DiscoveryError::Auth {
                endpoints: config.shown(),
                user: config.user().unwrap_or_default().to_string(),
                source,
            })
        }
        Ok(Err(source)) => Err(DiscoveryError::Request {
            endpoints: config.shown(),
            what: "connecting",
            source,
        }),
        Err(_) => Err(DiscoveryError::Unreachable {
            endpoints: config.shown(),
            what: "connecting",
            after: REQUEST_TIMEOUT,
            hint: hint(config),
        }),
    }
}

/// Runs one etcd call under [`REQUEST_TIMEOUT`].
pub(crate) async fn call<T>(
    config: &EtcdConfig,
    what: &'static str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) if is_unavailable(&source) => Err(DiscoveryError::Unavailable {
            endpoints: config.shown(),
            what,
            source,
            hint: hint(config),
        }),
        Ok(Err(source)) => Err(DiscoveryError::Request {
            endpoints: config.shown(),
            what,
            source,
        }),
        Err(_) => Err(DiscoveryError::Unreachable {
            endpoints: config.shown(),
            what,
            after: REQUEST_TIMEOUT,
            hint: hint(config),
        }),
    }
}

/// etcd no longer accepts the client's auth token: it restarted (simple
/// tokens live in its memory), the token expired, or the auth store
/// changed. Only a fresh client (which authenticates again) helps.
pub(crate) fn is_stale_token(error: &DiscoveryError) -> bool {
    let status = match error {
        DiscoveryError::Request {
            source: etcd_client::Error::GRpcStatus(status),
            ..
        } => status,
        _ => return false,
    };
    status.code() == tonic::Code::Unauthenticated
        || status.message().contains("revision of auth store is old")
}

/// A connection failure (refused, reset, unresolvable), as opposed to etcd
/// answering with an error.
fn is_unavailable(error: &etcd_client::Error) -> bool {
    match error {
        // Besides `UNAVAILABLE`: a status made from a transport error (code
        // `UNKNOWN` or `CANCELLED`), which is how a TLS server refusing the
        // client's certificate (or its lack of one) shows: the TLS 1.3
        // handshake seems to succeed and the alert or the closed connection
        // arrives with the first request.
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable
                || status
                    .source()
                    .is_some_and(|s| s.downcast_ref::<tonic::transport::Error>().is_some())
        }
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
        let Err(err) = connect(&EtcdConfig::new(Vec::<String>::new())).await else {
            panic!("connecting to no endpoints succeeded");
        };
        assert!(err.to_string().contains("http://127.0.0.1:2379"), "{err}");
    }
}
