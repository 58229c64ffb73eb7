//! W3C trace context over gRPC metadata.
//!
//! A client call carries its span's context as a `traceparent` header
//! (and `tracestate`, when there is one); the server makes that context the
//! parent of its request span. So the router's span, the decode worker's
//! and the prefill worker's share one trace id however many processes the
//! request crosses. Both directions are no-ops when the process does not
//! export traces: [`inject`] writes nothing for a span without an
//! OpenTelemetry context, and [`set_parent`] looks no further when the call
//! has no `traceparent`.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header that names the parent span.
pub const TRACEPARENT: &str = "traceparent";

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) else {
            return;
        };
        self.0.insert(k, v);
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes `span`'s trace context into an outgoing call's metadata. Writes
/// nothing when `span` has no OpenTelemetry context (export is off).
pub fn inject(span: &Span, metadata: &mut MetadataMap) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
}

/// Makes the trace context of an incoming call (if it has one) the parent
/// of `span`. Call it right after creating `span`, before entering it or
/// creating children: a span's parent is fixed once it starts.
pub fn set_parent(span: &Span, metadata: &MetadataMap) {
    if metadata.get(TRACEPARENT).is_none() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    // Without the OpenTelemetry layer (export off) there is nothing to set.
    let _ = span.set_parent(cx);
}

/// The trace id of `span` as 32 hex digits, when it has one.
pub fn trace_id(span: &Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn a_context_survives_the_round_trip_through_metadata() {
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let client = tracing::info_span!("client");
            let mut md = MetadataMap::new();
            inject(&client, &mut md);
            let header = md
                .get(TRACEPARENT)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let id = trace_id(&client).expect("client has a trace id");
            let header = header.expect("traceparent injected");
            assert!(header.contains(&id), "{header} names trace {id}");

            let server = tracing::info_span!("server");
            set_parent(&server, &md);
            assert_eq!(trace_id(&server).as_deref(), Some(id.as_str()));

            let unrelated = tracing::info_span!("unrelated");
            set_parent(&unrelated, &MetadataMap::new());
            assert_ne!(trace_id(&unrelated).as_deref(), Some(id.as_str()));
        });
    }

    #[test]
    fn without_the_layer_nothing_is_injected() {
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("plain");
            let mut md = MetadataMap::new();
            inject(&span, &mut md);
            assert!(md.get(TRACEPARENT).is_none());
            assert_eq!(trace_id(&span), None);
        });
    }
}
