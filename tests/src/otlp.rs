//! An OTLP/gRPC trace collector inside the test process: a tonic server
//! implementing `opentelemetry.proto.collector.trace.v1.TraceService` that
//! keeps every span it receives, flattened with its resource's
//! `service.name`, so tests can check what real processes exported.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;

/// One received span.
#[derive(Debug, Clone)]
pub struct Span {
    pub service: String,
    pub name: String,
    /// Hex, as in `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// Attribute values rendered as strings.
    pub attributes: HashMap<String, String>,
}

#[derive(Debug, Default, Clone)]
struct Store(Arc<Mutex<Vec<Span>>>);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn render(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attrs(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| {
            (
                kv.key.clone(),
                render(kv.value.as_ref().and_then(|v| v.value.as_ref())),
            )
        })
        .collect()
}

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let resource = rs
                .resource
                .map(|r| attrs(&r.attributes))
                .unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Span {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attributes: attrs(&s.attributes),
                    });
                }
            }
        }
        self.0
            .lock()
            .map_err(|_| tonic::Status::internal("poisoned"))?
            .extend(got);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running collector; stops when dropped (with its runtime).
#[derive(Debug)]
pub struct Collector {
    store: Store,
    addr: SocketAddr,
    _runtime: tokio::runtime::Runtime,
}

impl Collector {
    /// Serves on a free loopback port, on a runtime of its own.
    pub fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let store = Store::default();
        let service = TraceServiceServer::new(store.clone());
        runtime.spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Ok(Self {
            store,
            addr,
            _runtime: runtime,
        })
    }

    /// `http://ADDR`, for `--otlp-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.store
            .0
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Waits (at most `timeout`) until `done` holds for the spans received.
    pub fn wait_for(&self, timeout: Duration, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() > deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whether `ancestor` is `span`'s parent, grandparent, ... in `spans`.
pub fn is_ancestor(spans: &[Span], ancestor: &Span, span: &Span) -> bool {
    let by_id: HashMap<&str, &Span> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let mut cur = span;
    for _ in 0..spans.len() {
        if cur.parent_span_id.is_empty() {
            return false;
        }
        if cur.parent_span_id == ancestor.span_id {
            return true;
        }
        match by_id.get(cur.parent_span_id.as_str()) {
            Some(p) => cur = p,
            None => return false,
        }
    }
    false
}
