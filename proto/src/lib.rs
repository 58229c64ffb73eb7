//! tandem's gRPC API, generated from the `.proto` files in `proto/proto/`.
//!
//! [`v1`] is the public API (`proto/proto/tandem/v1/generate.proto`, package
//! `tandem.v1`): the `Generation` service with one server-streaming
//! `Generate` call, served by `tandem serve` and, later, by the router. A
//! stream carries `TokenDelta` messages and ends with exactly one `Finished`
//! message (finish reasons, usage, timings).
//!
//! `build.rs` runs `protoc` (via `tonic-prost-build`) at build time and
//! generates both sides: prost message types, the tonic client
//! ([`v1::generation_client::GenerationClient`]) and the server trait
//! ([`v1::generation_server::Generation`]). It also writes the compiled file
//! descriptor set to `OUT_DIR`, which is embedded here as
//! [`v1::FILE_DESCRIPTOR_SET`]; a server hands those bytes to
//! `tonic-reflection` so clients such as `grpcurl` or Python's
//! `grpc_reflection` can list and describe the service without the `.proto`.
//!
//! [`worker::v1`] (`proto/proto/tandem/worker/v1/worker.proto`) is the
//! worker-internal API: the KV layout descriptor, worker info and load
//! reports, the KV-event stream a worker sends the router (`Stored`,
//! `Removed`, `Cleared` by chained block hash, with sequence numbers), the
//! router-to-decode `Decode.Generate` (a public `GenerateRequest` plus the
//! prefill worker the router chose, as a typed field) and the
//! decode-to-prefill `Prefill` call. Users never see it.

pub mod deadline;

/// The public `tandem.v1` API: messages, the `Generation` client and server.
pub mod v1 {
    // Generated code: its doc comments come from the .proto.
    #![allow(missing_docs, clippy::all)]

    tonic::include_proto!("tandem.v1");

    /// The encoded `google.protobuf.FileDescriptorSet` of every `tandem.v1`
    /// file, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/tandem_v1_descriptor.bin"));

    /// The fully qualified name of the generation service.
    pub const GENERATION_SERVICE: &str = "tandem.v1.Generation";

    /// The fully qualified name of the chat service.
    pub const CHAT_SERVICE: &str = "tandem.v1.Chat";
}

/// The worker-internal API.
pub mod worker {
    /// Response metadata from the router naming the decode worker it chose
    /// (only when the router runs with `--debug-routing-headers`).
    pub const ROUTED_DECODE_HEADER: &str = "x-tandem-decode-worker";
    /// Response metadata from the router naming the prefill worker, if any
    /// (only with `--debug-routing-headers`).
    pub const ROUTED_PREFILL_HEADER: &str = "x-tandem-prefill-worker";

    /// Status metadata from a worker whose error concerns one request (an
    /// engine error while serving it), not the worker: the router passes
    /// it on and keeps routing to the worker. Statuses without it (the
    /// transport's, a backend failure's) may mean the worker is gone.
    pub const ERROR_SCOPE_HEADER: &str = "x-tandem-error-scope";
    /// [`ERROR_SCOPE_HEADER`]'s value.
    pub const REQUEST_SCOPE: &str = "request";

    /// [`ERROR_SCOPE_HEADER`]'s value on a request a draining decode worker
    /// handed over: it stopped there to go on elsewhere, and its KV blocks
    /// stay in that worker's prefix cache, to be pulled with `Prefill`
    /// from its address while it drains.
    pub const HANDED_OVER: &str = "handed-over";

    /// Marks `status` as a handed-over request ([`HANDED_OVER`]).
    pub fn handed_over(mut status: tonic::Status) -> tonic::Status {
        status.metadata_mut().insert(
            ERROR_SCOPE_HEADER,
            tonic::metadata::MetadataValue::from_static(HANDED_OVER),
        );
        status
    }

    /// Whether a draining worker handed the request over ([`HANDED_OVER`]).
    pub fn is_handed_over(status: &tonic::Status) -> bool {
        status
            .metadata()
            .get(ERROR_SCOPE_HEADER)
            .is_some_and(|v| v == HANDED_OVER)
    }

    /// Marks `status` as one request's failure ([`ERROR_SCOPE_HEADER`]).
    pub fn request_error(mut status: tonic::Status) -> tonic::Status {
        status.metadata_mut().insert(
            ERROR_SCOPE_HEADER,
            tonic::metadata::MetadataValue::from_static(REQUEST_SCOPE),
        );
        status
    }

    /// Whether a worker said `status` is one request's failure.
    pub fn is_request_error(status: &tonic::Status) -> bool {
        status
            .metadata()
            .get(ERROR_SCOPE_HEADER)
            .is_some_and(|v| v == REQUEST_SCOPE)
    }

    /// `tandem.worker.v1`: router ↔ worker and decode ↔ prefill messages.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]

        tonic::include_proto!("tandem.worker.v1");

        /// The encoded descriptor set of `tandem.worker.v1`, for reflection.
        pub const FILE_DESCRIPTOR_SET: &[u8] =
            include_bytes!(concat!(env!("OUT_DIR"), "/tandem_worker_v1_descriptor.bin"));
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use prost_types::FileDescriptorSet;

    use super::v1;

    #[test]
    fn descriptor_set_describes_the_streaming_generate_method() {
        let set = FileDescriptorSet::decode(v1::FILE_DESCRIPTOR_SET)
            .expect("the embedded descriptor set decodes");
        let file = set
            .file
            .iter()
            .find(|f| f.package() == "tandem.v1")
            .expect("a tandem.v1 file");
        let service = file
            .service
            .iter()
            .find(|s| format!("{}.{}", file.package(), s.name()) == v1::GENERATION_SERVICE)
            .expect("service tandem.v1.Generation");
        let method = service
            .method
            .iter()
            .find(|m| m.name() == "Generate")
            .expect("method Generate");
        assert!(method.server_streaming(), "Generate streams its responses");
        assert!(!method.client_streaming(), "Generate takes one request");
        assert_eq!(method.input_type(), ".tandem.v1.GenerateRequest");
        assert_eq!(method.output_type(), ".tandem.v1.GenerateResponse");
    }

    #[test]
    fn generated_messages_round_trip() {
        let req = v1::GenerateRequest {
            request_id: "r1".into(),
            prompt: Some(v1::generate_request::Prompt::Text("hi".into())),
            max_tokens: Some(4),
            ..Default::default()
        };
        let bytes = req.encode_to_vec();
        let back = v1::GenerateRequest::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back, req);
    }
}
