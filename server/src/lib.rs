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
mod service;

use std::future::Future;
use std::net::SocketAddr;

use tandem_engine::serving::EngineHandle;
use tandem_proto::v1;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

pub use convert::{event_to_proto, request_from_proto, BadRequest};
pub use service::{status_from_engine, GenerationService};

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

/// Serves `Generation`, health and reflection until `shutdown` completes.
pub async fn serve(
    bound: Bound,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<v1::generation_server::GenerationServer<GenerationService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let generation = v1::generation_server::GenerationServer::new(GenerationService::new(engine));
    tracing::info!(addr = %bound.addr, "serving tandem.v1.Generation");
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(generation)
        .serve_with_incoming_shutdown(TcpListenerStream::new(bound.listener), shutdown)
        .await?;
    health
        .set_not_serving::<v1::generation_server::GenerationServer<GenerationService>>()
        .await;
    Ok(())
}
