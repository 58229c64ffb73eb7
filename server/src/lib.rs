//! The public gRPC front of one serving engine: `tandem serve`.
//!
//! [`serve`] exposes an [`EngineHandle`] as the `tandem.v1.Generation`
//! service, with the standard `grpc.health.v1.Health` service (SERVING while
//! the engine runs) and gRPC server reflection (v1 and v1alpha), so stock
//! tools (`grpcurl`, `grpc_health_probe`, Python's `grpc_reflection`) work
//! against it. Each `Generate` call is one engine request; when the client
//! cancels or disconnects, tonic drops the response stream, which drops the
//! engine's [`RequestStream`](tandem_engine::serving::RequestStream), which
//! aborts the request and frees its KV blocks.
//!
//! **Architecture Invariant:** this crate translates and transports; it does
//! no scheduling and holds no KV state. The decode worker will reuse the
//! service for its locally prefilled requests.

mod convert;
pub mod layout;
pub mod listener;
pub mod metrics;
mod peer_costs;
mod service;
mod worker_service;

use std::future::Future;
use std::net::SocketAddr;

use tandem_engine::serving::EngineHandle;
use tandem_proto::v1;
use tokio::net::TcpListener;
use tonic::service::RoutesBuilder;

pub use convert::{
    event_to_proto, logprob_from_proto, logprob_to_proto, request_from_proto, BadRequest,
};
pub use metrics::{register_engine, register_transport, ServingMetrics};
pub use peer_costs::PeerFetchCosts;
pub use service::{status_from_engine, status_from_failure, GenerationService};
pub use worker_service::{shutdown_ending_feeds, FeedsEnd, WorkerIdentity, WorkerService};

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reflection service: {0}")]
    Reflection(String),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A bound listener, so callers learn the port (e.g. of `127.0.0.1:0`)
/// before serving.
#[derive(Debug)]
pub struct Bound {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Bound {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr) -> Result<Self, ServeError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ServeError::Bind { addr, source })?;
        Ok(Self { listener, addr })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The address peers should dial for a listener bound to `bound`: its port
/// on `host` (an IPv6 literal gets brackets), or `bound` itself when no host
/// is given. A worker bound to `0.0.0.0` in a pod advertises the pod's IP.
pub fn advertised_addr(host: Option<&str>, bound: SocketAddr) -> String {
    match host {
        None => bound.to_string(),
        Some(h) if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{}", bound.port()),
        Some(h) => format!("{h}:{}", bound.port()),
    }
}

/// The largest gRPC message a tandem server decodes (a request) or encodes
/// (a response). tonic's default decoding limit is the same 4 MiB; it is
/// set explicitly on every service so the limit is one visible number. A
/// larger request is refused with `OUT_OF_RANGE` before it is parsed.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 4 << 20;

/// What one gRPC server offers: services, the names health reports as
/// SERVING, the descriptor sets reflection describes, and its TLS settings.
#[derive(Debug, Default)]
pub struct Services {
    routes: RoutesBuilder,
    serving: Vec<&'static str>,
    descriptors: Vec<&'static [u8]>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    /// Connections served at once; `None`: [`listener::MAX_GRPC_CONNECTIONS`].
    max_connections: Option<usize>,
}

impl Services {
    /// The public `Generation` service over `generation`, unguarded.
    pub fn generation(generation: GenerationService) -> Self {
        Self::guarded_generation(std::sync::Arc::new(generation), Ok)
    }

    /// The `Generation` service over `service`, every call checked by
    /// `interceptor` first (API keys on a public server, the cluster
    /// credential on a decode worker). Health and reflection, added by
    /// [`serve_services`], stay open.
    pub fn guarded_generation<S, I>(service: std::sync::Arc<S>, interceptor: I) -> Self
    where
        S: v1::generation_server::Generation,
        I: tonic::service::Interceptor + Clone + Send + Sync + 'static,
    {
        let server = v1::generation_server::GenerationServer::from_arc(service)
            .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
        let mut s = Self::default();
        s.add(
            tonic::service::interceptor::InterceptedService::new(server, interceptor),
            v1::GENERATION_SERVICE,
            v1::FILE_DESCRIPTOR_SET,
        );
        s
    }

    /// Serves over TLS with these settings (mutual TLS when they name a
    /// client CA, as [`tandem_security::LoadedTls::server`]'s do).
    pub fn with_tls(&mut self, tls: Option<tonic::transport::ServerTlsConfig>) -> &mut Self {
        self.tls = tls;
        self
    }

    /// Serves at most `max` connections at once (one more is closed at
    /// accept); the default is [`listener::MAX_GRPC_CONNECTIONS`].
    pub fn with_max_connections(&mut self, max: usize) -> &mut Self {
        self.max_connections = Some(max);
        self
    }

    /// Adds a service, its health name and its descriptor set. Any service
    /// tonic routes will do, e.g. one wrapped in an interceptor.
    pub fn add<S>(&mut self, svc: S, name: &'static str, descriptor: &'static [u8]) -> &mut Self
    where
        S: tower_service::Service<
                http::Request<tonic::body::Body>,
                Error = std::convert::Infallible,
            > + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.routes.add_service(svc);
        self.serving.push(name);
        if !self.descriptors.contains(&descriptor) {
            self.descriptors.push(descriptor);
        }
        self
    }
}

/// Streams one gRPC connection may have open at once. A router multiplexes
/// all its calls to one worker over one connection, so this is the most
/// requests one router can have in flight on a worker: far above any batch
/// the engine runs, far below what would exhaust memory.
pub const MAX_CONCURRENT_STREAMS: u32 = 4096;

/// Serves `services` plus `grpc.health.v1` and reflection (v1 and v1alpha)
/// until `shutdown` completes, with HTTP/2 keep-alive pings to every peer
/// and at most [`MAX_CONCURRENT_STREAMS`] streams per connection.
pub async fn serve_services(
    bound: Bound,
    services: Services,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in &services.serving {
        health
            .set_service_status(*name, tonic_health::ServingStatus::Serving)
            .await;
    }
    let mut v1_builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    let mut alpha_builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for d in &services.descriptors {
        v1_builder = v1_builder.register_encoded_file_descriptor_set(d);
        alpha_builder = alpha_builder.register_encoded_file_descriptor_set(d);
    }
    let reflection = v1_builder
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_alpha = alpha_builder
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let mut routes = services.routes;
    routes.add_service(health_service);
    routes.add_service(reflection);
    routes.add_service(reflection_alpha);
    let max_connections = services
        .max_connections
        .unwrap_or(listener::MAX_GRPC_CONNECTIONS);
    tracing::info!(addr = %bound.addr, services = ?services.serving, tls = services.tls.is_some(), max_connections, "serving");
    // A peer that stops answering pings (frozen, partitioned) is dropped
    // after interval + timeout, freeing its streams; one connection may
    // not open streams without end.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(tandem_security::tls::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(tandem_security::tls::KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    if let Some(tls) = services.tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .add_routes(routes.routes())
        .serve_with_incoming_shutdown(
            listener::capped(
                bound.listener,
                max_connections,
                listener::FIRST_BYTE_TIMEOUT,
            ),
            shutdown,
        )
        .await?;
    for name in &services.serving {
        health
            .set_service_status(*name, tonic_health::ServingStatus::NotServing)
            .await;
    }
    Ok(())
}

/// Serves `Generation` from `engine` (the colocated server), with health and
/// reflection, until `shutdown` completes.
pub async fn serve(
    bound: Bound,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_services(
        bound,
        Services::generation(GenerationService::new(engine)),
        shutdown,
    )
    .await
}
