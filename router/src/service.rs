//! The router's `tandem.v1.Generation`: pick workers, forward, stream back.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::Stream;
use tandem_engine::tokenizer::Tokenizer;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::{PREFILL_HEADER, ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::policy::{Candidate, RoutingPolicy};
use crate::pool::{Cluster, InFlight, Role, Worker};

/// Routes `Generate` calls over a cluster.
#[derive(Debug)]
pub struct RouterService {
    cluster: Arc<Cluster>,
    tokenizer: Option<Arc<Tokenizer>>,
    decode_policy: Box<dyn RoutingPolicy>,
    prefill_policy: Box<dyn RoutingPolicy>,
    /// Prefill remotely only when this many prompt tokens are not cached at
    /// the chosen decode worker.
    remote_prefill_threshold: usize,
    /// A prefill worker with this many requests in flight is saturated;
    /// when all are, the decode worker prefills locally.
    max_prefill_queue: usize,
}

impl RouterService {
    pub fn new(
        cluster: Arc<Cluster>,
        tokenizer: Option<Arc<Tokenizer>>,
        decode_policy: Box<dyn RoutingPolicy>,
        prefill_policy: Box<dyn RoutingPolicy>,
        remote_prefill_threshold: usize,
        max_prefill_queue: usize,
    ) -> Self {
        Self {
            cluster,
            tokenizer,
            decode_policy,
            prefill_policy,
            remote_prefill_threshold,
            max_prefill_queue: max_prefill_queue.max(1),
        }
    }

    fn candidates(&self, workers: &[Arc<Worker>], hashes: &[u64]) -> Vec<Candidate> {
        let index = self.cluster.index.lock().unwrap_or_else(|e| e.into_inner());
        workers
            .iter()
            .map(|w| Candidate {
                matched_blocks: index.matched(w.slot, hashes),
                active_requests: w.active_requests.load(Ordering::Relaxed),
                active_blocks: w.reported_blocks.load(Ordering::Relaxed)
                    + w.inflight_blocks.load(Ordering::Relaxed),
            })
            .collect()
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

/// The forwarded call; dropping it cancels the upstream call and releases
/// the load counters.
struct Proxy {
    upstream: Streaming<v1::GenerateResponse>,
    decode: Arc<Worker>,
    _decode_load: InFlight,
    /// Released at the first token: prefill is over by then.
    prefill_load: Option<InFlight>,
    ended: bool,
}

impl Proxy {
    async fn next(&mut self) -> Option<Result<v1::GenerateResponse, Status>> {
        if self.ended {
            return None;
        }
        match self.upstream.message().await {
            Ok(Some(msg)) => {
                self.prefill_load = None;
                Some(Ok(msg))
            }
            Ok(None) => {
                self.ended = true;
                None
            }
            Err(status) => {
                self.ended = true;
                if matches!(
                    status.code(),
                    Code::Unavailable | Code::Unknown | Code::Internal
                ) {
                    self.decode.mark_down();
                }
                Some(Err(Status::unavailable(format!(
                    "decode worker {}: {}",
                    self.decode.addr,
                    status.message()
                ))))
            }
        }
    }
}

#[tonic::async_trait]
impl v1::generation_server::Generation for RouterService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let mut req = request.into_inner();
        let tokens = match &req.prompt {
            Some(v1::generate_request::Prompt::TokenIds(ids)) => Some(ids.ids.clone()),
            Some(v1::generate_request::Prompt::Text(text)) => match &self.tokenizer {
                Some(tok) if !text.is_empty() => Some(
                    tok.encode(text)
                        .map_err(|e| Status::invalid_argument(format!("prompt: {e}")))?,
                ),
                _ => None,
            },
            None => {
                return Err(Status::invalid_argument(
                    "prompt: one of prompt.text or prompt.token_ids is required",
                ))
            }
        };
        // Workers get token ids: tokenized once, and hashed as routed.
        if let Some(t) = &tokens {
            req.prompt = Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: t.clone(),
            }));
        }
        let bs = self.cluster.block_size().unwrap_or(16);
        let prompt_len = tokens.as_ref().map_or(0, Vec::len);
        let hashes = tokens
            .as_deref()
            .map(|t| tandem_block_hash::block_hashes(t, bs))
            .unwrap_or_default();

        let decodes = self.cluster.healthy(Role::Decode);
        if decodes.is_empty() {
            return Err(Status::unavailable("no decode worker is available"));
        }
        let cands = self.candidates(&decodes, &hashes);
        let di = self.decode_policy.pick(&cands, hashes.len());
        let decode = decodes[di].clone();
        let uncached = prompt_len.saturating_sub(cands[di].matched_blocks * bs);

        // Conditional disaggregation: remote only for a long uncached part
        // and an unsaturated prefill pool, and for one choice (the engine
        // forks `n > 1` choices from a local prefill).
        let prefill = if req.n <= 1 && uncached >= self.remote_prefill_threshold.max(1) {
            let pool: Vec<Arc<Worker>> = self
                .cluster
                .healthy(Role::Prefill)
                .into_iter()
                .filter(|w| w.active_requests.load(Ordering::Relaxed) < self.max_prefill_queue)
                .collect();
            if pool.is_empty() {
                None
            } else {
                let pc = self.candidates(&pool, &hashes);
                Some(pool[self.prefill_policy.pick(&pc, hashes.len())].clone())
            }
        } else {
            None
        };

        let mut forward = Request::new(req);
        if let Some(p) = &prefill {
            let v = MetadataValue::try_from(p.addr.as_str())
                .map_err(|_| Status::internal("prefill worker address is not a header value"))?;
            forward.metadata_mut().insert(PREFILL_HEADER, v);
        }
        let decode_load = InFlight::new(decode.clone(), prompt_len.div_ceil(bs));
        let prefill_load = prefill
            .as_ref()
            .map(|p| InFlight::new(p.clone(), uncached.div_ceil(bs)));
        let mut client = GenerationClient::new(decode.channel.clone());
        let upstream = match client.generate(forward).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == Code::InvalidArgument => return Err(status),
            Err(status) => {
                decode.mark_down();
                return Err(Status::unavailable(format!(
                    "decode worker {}: {}",
                    decode.addr,
                    status.message()
                )));
            }
        };
        tracing::debug!(decode = %decode.addr, prefill = ?prefill.as_ref().map(|p| &p.addr), "routed");
        let proxy = Proxy {
            upstream,
            decode: decode.clone(),
            _decode_load: decode_load,
            prefill_load,
            ended: false,
        };
        let stream = futures_util::stream::unfold(proxy, |mut p| async move {
            let item = p.next().await?;
            Some((item, p))
        });
        let mut response = Response::new(Box::pin(stream) as ResponseStream);
        if let Ok(v) = MetadataValue::try_from(decode.addr.as_str()) {
            response.metadata_mut().insert(ROUTED_DECODE_HEADER, v);
        }
        if let Some(p) = &prefill {
            if let Ok(v) = MetadataValue::try_from(p.addr.as_str()) {
                response.metadata_mut().insert(ROUTED_PREFILL_HEADER, v);
            }
        }
        Ok(response)
    }
}
