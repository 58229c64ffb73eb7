//! The router's `tandem.v1.Generation`: pick workers, forward, stream back.
//!
//! Each call runs in a `generate` span that lives as long as the proxied
//! stream; a `routing` child records every candidate's score, the picks
//! and the reasons. The span's W3C context is injected into the forwarded
//! call, so the decode worker's spans (and through it the prefill
//! worker's) join the caller's trace. A request without an id gets one
//! here, so every process logs it under the same `request_id`. The
//! proxied stream, and migration when a decode worker fails mid-stream,
//! are in `proxy.rs`.

use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::Stream;
use tandem_block_hash::BlockHash;
use tandem_proto::v1;
use tandem_proto::worker::v1::decode_client::DecodeClient;
use tandem_proto::worker::v1::{self as wv1, RoutedGenerateRequest};
use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
use tandem_tokenizer::Tokenizer;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use crate::metrics::RouterMetrics;
use crate::peer::PeerDecision;
use crate::policy::{Candidate, PromptFacts, RoutingPolicy};
use crate::pool::{Cluster, InFlight, Role, Worker};
use crate::prompt::PromptPrep;
use crate::proxy::{outcome_of, upstream_status, worker_failed, Proxy, Resume};

/// Routes `Generate` calls over a cluster.
#[derive(Debug)]
pub struct RouterService {
    cluster: Arc<Cluster>,
    prompts: PromptPrep,
    decode_policy: Box<dyn RoutingPolicy>,
    prefill_policy: Box<dyn RoutingPolicy>,
    /// Prefill remotely only when this many prompt tokens are not cached at
    /// the chosen decode worker.
    remote_prefill_threshold: usize,
    /// A prefill worker with this many requests in flight is saturated;
    /// when all are, the decode worker prefills locally.
    max_prefill_queue: usize,
    /// How long a request waits for a decode worker when none is healthy
    /// (within its deadline) before UNAVAILABLE.
    worker_wait: Duration,
    /// Tell clients which workers served them ([`ROUTED_DECODE_HEADER`],
    /// [`ROUTED_PREFILL_HEADER`]); off by default, since worker addresses
    /// are the cluster's business, not a client's.
    routing_headers: bool,
    /// Let a decode worker pull a prefix from a peer holding more of it
    /// ([`crate::peer`]); on by default.
    peer_fetch: bool,
    metrics: Arc<RouterMetrics>,
}

/// [`RouterService::with_worker_wait`]'s default: rides out a membership blip
/// (workers re-registering after an etcd outage, a rolling restart) without
/// holding a request long when the pool is really empty.
pub const DEFAULT_WORKER_WAIT: Duration = Duration::from_secs(2);

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
            prompts: PromptPrep::new(
                tokenizer,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            decode_policy,
            prefill_policy,
            remote_prefill_threshold,
            max_prefill_queue: max_prefill_queue.max(1),
            worker_wait: DEFAULT_WORKER_WAIT,
            routing_headers: false,
            peer_fetch: true,
            metrics: RouterMetrics::register(&tandem_telemetry::Registry::new()),
        }
    }

    /// How long a request may wait for a healthy decode worker when there
    /// is none (default [`DEFAULT_WORKER_WAIT`]; zero refuses at once).
    pub fn with_worker_wait(mut self, wait: Duration) -> Self {
        self.worker_wait = wait;
        self
    }

    /// Whether decode workers may pull prefixes from peers
    /// (`--no-peer-fetch` turns it off: every uncached token is then
    /// computed, as before peer fetch existed).
    pub fn with_peer_fetch(mut self, on: bool) -> Self {
        self.peer_fetch = on;
        self
    }

    /// Names the chosen workers in every response's metadata (for
    /// debugging and tests: `--debug-routing-headers`).
    pub fn with_routing_headers(mut self, on: bool) -> Self {
        self.routing_headers = on;
        self
    }

    /// Healthy decode workers; when there are none, polls for one until
    /// `worker_wait` (or the request's deadline) has passed.
    async fn wait_for_decodes(
        &self,
        started: Instant,
        timeout: Option<Duration>,
    ) -> Vec<Arc<Worker>> {
        let limit = timeout.map_or(self.worker_wait, |t| t.min(self.worker_wait));
        loop {
            let decodes = self.cluster.healthy(Role::Decode);
            if !decodes.is_empty() || started.elapsed() >= limit {
                return decodes;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Records requests and decisions in `metrics` (by default, a registry
    /// of its own).
    pub fn with_metrics(mut self, metrics: Arc<RouterMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Where the block-hash chains of requests under adapter `lora` start:
    /// the root a decode worker serving it announced ([`ROOT`] for the
    /// base model, or when no worker serves it).
    ///
    /// [`ROOT`]: tandem_block_hash::ROOT
    fn adapter_root(&self, lora: &str) -> tandem_block_hash::BlockHash {
        if lora.is_empty() {
            return tandem_block_hash::ROOT;
        }
        let decodes = self.cluster.healthy(Role::Decode);
        let root = decodes.iter().find_map(|w| w.adapter_root(lora));
        root.unwrap_or(tandem_block_hash::ROOT)
    }

    /// What the policies weigh of each of `workers` for `ask`. A long
    /// walk runs on the blocking pool: the async threads carry every other
    /// request's I/O.
    async fn candidates(&self, workers: &[Arc<Worker>], ask: &Ask) -> Vec<Candidate> {
        let slots: Vec<usize> = workers.iter().map(|w| w.slot).collect();
        // Read once: a disk tier's index is walked only when it holds blocks.
        let disk = !self.cluster.disk_index.is_empty();
        let matched = if self.walks_inline(&slots, ask.hashes.len(), disk) {
            match_tiers(&self.cluster, &slots, &ask.hashes, disk)
        } else {
            let (cluster, hashes) = (self.cluster.clone(), ask.hashes.clone());
            let walk = move || match_tiers(&cluster, &slots, &hashes, disk);
            tokio::task::spawn_blocking(walk).await.unwrap_or_else(|e| {
                // Routed by load alone rather than not at all.
                tracing::error!(error = %e, "matching the prompt against the KV index failed");
                vec![(0, 0); workers.len()]
            })
        };
        let lora = ask.lora.as_str();
        workers
            .iter()
            .zip(matched)
            .map(|(w, (matched_blocks, disk_blocks))| Candidate {
                matched_blocks,
                disk_blocks,
                // Read only where it matters: a lock per candidate otherwise.
                disk_block_cost: (disk_blocks > matched_blocks)
                    .then(|| w.disk_block_cost())
                    .flatten(),
                active_requests: w.active_requests.load(Ordering::Relaxed),
                active_blocks: w.reported_blocks.load(Ordering::Relaxed)
                    + w.inflight_blocks.load(Ordering::Relaxed),
                adapter_cold: !lora.is_empty() && !w.adapter_resident(lora),
                identity: w.identity,
            })
            .collect()
    }

    /// Whether matching `blocks` blocks for `slots` walks few enough words
    /// of holder bits to stay on the async thread. A walk reads a word per
    /// 64 dense worker ids, up to the highest candidate's whose set is not
    /// certified closed, per tier walked; certified candidates are
    /// searched (a few lookups, whatever the prompt's length). The words
    /// up to the highest id in use bound that from above with no lookup
    /// per candidate; only when the bound is too high are they counted.
    /// `disk_on`: the disk tier's index is walked too.
    fn walks_inline(&self, slots: &[usize], blocks: usize, disk_on: bool) -> bool {
        let (pool, disk) = (&self.cluster.index, &self.cluster.disk_index);
        let bound = pool.id_words() + if disk_on { disk.id_words() } else { 0 };
        if blocks * bound <= INLINE_MATCH_WORDS {
            return true;
        }
        let words = pool.walk_words(slots) + if disk_on { disk.walk_words(slots) } else { 0 };
        blocks * words <= INLINE_MATCH_WORDS
    }
}

/// Each worker's leading blocks of `hashes` in its pool and in its disk
/// tier (the second walk only when `disk`: some worker has a disk tier).
fn match_tiers(
    cluster: &Cluster,
    slots: &[usize],
    hashes: &[BlockHash],
    disk: bool,
) -> Vec<(usize, usize)> {
    let pool = cluster.index.matched(slots, hashes);
    if !disk {
        return pool.into_iter().map(|m| (m, 0)).collect();
    }
    let disk = cluster.disk_index.matched(slots, hashes);
    pool.into_iter().zip(disk).collect()
}

/// What a pick weighs of a request: its block hashes, the policy's facts,
/// and the adapter it runs under (with the adapter's hash root).
struct Ask {
    hashes: Arc<Vec<tandem_block_hash::BlockHash>>,
    facts: PromptFacts,
    lora: String,
    root: tandem_block_hash::BlockHash,
}

impl Ask {
    /// Whether `w` serves the request's adapter (any worker, for none).
    fn serves(&self, w: &Worker) -> bool {
        self.lora.is_empty() || w.adapter_root(&self.lora) == Some(self.root)
    }
}

/// A prompt whose walk reads up to this many words of holder bits (its
/// blocks × one 64-bit word per 64 uncertified candidates,
/// [`KvIndex::walk_words`](crate::index::KvIndex::walk_words), per tier
/// indexed) is matched against the index on the async thread; a longer
/// walk on the blocking pool. Workers that certify their sets
/// prefix-closed (engines and the simulated workers do) walk no words. In
/// the router a walk costs up to ~35 ns a block per word (lines go cold
/// between requests), so an inline walk costs up to ~75 µs: 32k tokens (2,048 blocks of 16) at up to 64 workers
/// without a disk tier, 8k at 256. The hop to the blocking pool and back
/// cost more than such a walk: 32k-token decisions at 64 workers took
/// 89–145 µs p50 and 320–484 µs p99 with it, 39–88 / 100–300 inline
/// (`router-bench`, bench/RESULTS.md).
const INLINE_MATCH_WORDS: usize = 2048;

type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::GenerateResponse, Status>> + Send>>;

/// Candidates a routing span lists: the pick and the next best. Listing
/// all of 256 cost a tenth of the router's CPU per request.
const SPAN_CANDIDATES: usize = 8;

/// `addr matched=.. requests=.. blocks=..` for the pick and the candidates
/// with the longest matches, at most [`SPAN_CANDIDATES`], for the span.
fn scores(workers: &[Arc<Worker>], cands: &[Candidate], picked: usize) -> String {
    let mut order: Vec<usize> = (0..cands.len()).filter(|&i| i != picked).collect();
    order.sort_by_key(|&i| {
        (
            std::cmp::Reverse(cands[i].matched_blocks),
            cands[i].active_blocks,
        )
    });
    order.truncate(SPAN_CANDIDATES.saturating_sub(1));
    order.insert(0, picked);
    let mut out = String::new();
    for i in order.into_iter().filter(|&i| i < cands.len()) {
        if !out.is_empty() {
            out.push_str("; ");
        }
        let (w, c) = (&workers[i], &cands[i]);
        let _ = write!(
            out,
            "{} matched_blocks={} disk_blocks={} active_requests={} active_blocks={}",
            w.addr, c.matched_blocks, c.disk_blocks, c.active_requests, c.active_blocks
        );
    }
    if cands.len() > SPAN_CANDIDATES {
        let _ = write!(out, "; {} more", cands.len() - SPAN_CANDIDATES);
    }
    out
}

fn new_request_id() -> String {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("rt-{}-{n}", std::process::id())
}

#[tonic::async_trait]
impl v1::generation_server::Generation for RouterService {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let started = Instant::now();
        let span = tracing::info_span!(
            "generate",
            otel.kind = "server",
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            decode_worker = tracing::field::Empty,
            prefill_worker = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        tandem_telemetry::propagation::set_parent(&span, request.metadata());
        let timeout = tandem_proto::deadline::grpc_timeout(request.metadata());
        let result = self
            .route(request.into_inner(), &span, started, timeout)
            .await;
        if let Err(status) = &result {
            let outcome = outcome_of(status);
            self.metrics.request(outcome);
            span.record("outcome", outcome);
            tracing::debug!(parent: &span, error = %status.message(), "request refused");
        }
        result
    }
}

impl RouterService {
    /// The placement that sends a prompt's prefill to `worker`: the decode
    /// worker asks it only if the prompt's uncached part still reaches the
    /// threshold against its own cache.
    fn placement(&self, worker: &str) -> wv1::PrefillPlacement {
        wv1::PrefillPlacement {
            worker: worker.to_string(),
            min_uncached_tokens: self.min_uncached_tokens(),
        }
    }

    /// The remote-prefill threshold as placements carry it.
    fn min_uncached_tokens(&self) -> u32 {
        u32::try_from(self.remote_prefill_threshold.max(1)).unwrap_or(u32::MAX)
    }

    /// Conditional disaggregation: a prefill worker only for a long
    /// uncached part and an unsaturated prefill pool, and why. `n > 1`
    /// choices go remote too: the decode engine forks them off choice 0 once
    /// the prefilled prompt's last token is computed, as after a local
    /// prefill. Adds the pick's time to `decision_time`.
    async fn place_prefill(
        &self,
        uncached: usize,
        ask: &Ask,
        routing: &tracing::Span,
        decision_time: &mut Duration,
    ) -> (Option<Arc<Worker>>, &'static str) {
        if uncached < self.remote_prefill_threshold.max(1) {
            return (None, "below_threshold");
        }
        let mut all = self.cluster.healthy(Role::Prefill);
        all.retain(|w| ask.serves(w));
        let pool: Vec<Arc<Worker>> = all
            .iter()
            .filter(|w| w.active_requests.load(Ordering::Relaxed) < self.max_prefill_queue)
            .cloned()
            .collect();
        if all.is_empty() {
            return (None, "no_prefill_worker");
        }
        if pool.is_empty() {
            return (None, "prefill_pool_saturated");
        }
        let deciding = Instant::now();
        let pc = self.candidates(&pool, ask).await;
        let pick = self.prefill_policy.decide(&pc, ask.facts);
        *decision_time += deciding.elapsed();
        self.metrics
            .decision("prefill", self.prefill_policy.name(), pick.reason);
        if !routing.is_disabled() {
            routing.record(
                "prefill_candidates",
                scores(&pool, &pc, pick.index).as_str(),
            );
        }
        routing.record("prefill_reason", pick.reason);
        (Some(pool[pick.index].clone()), "above_threshold")
    }

    /// Whether the chosen decode worker should pull the prompt's prefix
    /// from another decode worker that holds more of it ([`crate::peer`]).
    fn peer_fetch(
        &self,
        decodes: &[Arc<Worker>],
        cands: &[Candidate],
        chosen: usize,
        bs: usize,
    ) -> PeerDecision {
        if !self.peer_fetch {
            return PeerDecision::Compute("peer_fetch_off");
        }
        let addrs: Vec<&str> = decodes.iter().map(|w| w.addr.as_str()).collect();
        let min_blocks = self.remote_prefill_threshold.div_ceil(bs.max(1));
        crate::peer::decide(
            cands,
            &|i| decodes[i].measured(),
            &addrs,
            chosen,
            min_blocks,
        )
    }

    /// Picks the workers, forwards the call and returns the proxied stream
    /// (which owns `span`'s clone, so the span ends with it).
    async fn route(
        &self,
        mut req: v1::GenerateRequest,
        span: &tracing::Span,
        started: Instant,
        timeout: Option<std::time::Duration>,
    ) -> Result<Response<ResponseStream>, Status> {
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        span.record("request_id", req.request_id.as_str());
        let bs = self.cluster.block_size().unwrap_or(16);
        // A request under a LoRA adapter hashes its blocks from the
        // adapter's root, as the workers serving it do.
        let root = self.adapter_root(&req.lora);
        let prompt = req.prompt.take().ok_or_else(|| {
            Status::invalid_argument("prompt: one of prompt.text or prompt.token_ids is required")
        })?;
        let prepared = self.prompts.prepare(prompt, root, bs).await?;
        req.prompt = Some(prepared.prompt);
        let prompt_len = prepared.token_count.unwrap_or(0);
        span.record("prompt_tokens", prompt_len);
        let ask = Ask {
            facts: PromptFacts {
                blocks: prepared.hashes.len(),
                key: prepared.key,
            },
            hashes: prepared.hashes,
            lora: req.lora.clone(),
            root,
        };
        let picked = self
            .pick_workers(&ask, prompt_len, bs, span, started, timeout)
            .await?;

        let resume = Some(Resume::for_request(
            self.cluster.clone(),
            &req,
            timeout.map(|t| started + t),
            bs,
            self.min_uncached_tokens(),
        ));
        let prefill_load = picked
            .prefill
            .as_ref()
            .map(|p| InFlight::new(p.clone(), picked.uncached.div_ceil(bs)));
        let call = Forward {
            span,
            started,
            timeout,
            prefill: picked.prefill.as_ref().map(|p| self.placement(&p.addr)),
        };
        let (upstream, decode, decode_load) = self
            .call_decode(picked.decode, &req, &call, prompt_len.div_ceil(bs))
            .await?;
        self.metrics.prompt_tokens.add(prompt_len as u64);
        let proxy = Proxy {
            upstream,
            decode: decode.clone(),
            decode_load,
            prefill_load,
            ended: false,
            span: span.clone(),
            metrics: self.metrics.clone(),
            started,
            first_token: None,
            generated: 0,
            resume,
        };
        let stream = futures_util::stream::unfold(proxy, |mut p| async move {
            let item = p.next().await?;
            Some((item, p))
        });
        let mut response = Response::new(Box::pin(stream) as ResponseStream);
        if self.routing_headers {
            name_workers(&mut response, &decode, picked.prefill.as_deref());
        }
        Ok(response)
    }

    /// The decode worker (and prefill worker, if any) for `ask`, recorded
    /// in a `routing` span under `span`, with the decision timed.
    async fn pick_workers(
        &self,
        ask: &Ask,
        prompt_len: usize,
        bs: usize,
        span: &tracing::Span,
        started: Instant,
        timeout: Option<Duration>,
    ) -> Result<Picked, Status> {
        let mut decodes = self.wait_for_decodes(started, timeout).await;
        if decodes.is_empty() {
            return Err(Status::unavailable(format!(
                "no decode worker is available (waited {} ms)",
                started.elapsed().as_millis()
            )));
        }
        decodes.retain(|w| ask.serves(w));
        if decodes.is_empty() {
            return Err(Status::invalid_argument(format!(
                "lora: no decode worker serves adapter `{}`",
                ask.lora
            )));
        }
        let routing = tracing::info_span!(
            parent: span,
            "routing",
            decode_policy = self.decode_policy.name(),
            decode_reason = tracing::field::Empty,
            decode_worker = tracing::field::Empty,
            decode_candidates = tracing::field::Empty,
            uncached_tokens = tracing::field::Empty,
            prefill_placement = tracing::field::Empty,
            prefill_reason = tracing::field::Empty,
            prefill_policy = self.prefill_policy.name(),
            prefill_worker = tracing::field::Empty,
            prefill_candidates = tracing::field::Empty,
        );
        let deciding = Instant::now();
        let cands = self.candidates(&decodes, ask).await;
        let pick = self.decode_policy.decide(&cands, ask.facts);
        let mut decision_time = deciding.elapsed();
        let decode = decodes[pick.index].clone();
        // Blocks on the decode worker's disk come back from there: not
        // worth a remote prefill either.
        let held = cands[pick.index]
            .matched_blocks
            .max(cands[pick.index].disk_blocks);
        let uncached = prompt_len.saturating_sub(held * bs);
        self.metrics
            .decision("decode", self.decode_policy.name(), pick.reason);
        if !routing.is_disabled() {
            let listed = scores(&decodes, &cands, pick.index);
            routing.record("decode_candidates", listed.as_str());
        }
        routing.record("decode_reason", pick.reason);
        routing.record("decode_worker", decode.addr.as_str());
        routing.record("uncached_tokens", uncached);

        let (prefill, placement, placement_reason) =
            match self.peer_fetch(&decodes, &cands, pick.index, bs) {
                PeerDecision::Fetch { peer, reason, .. } => {
                    (Some(decodes[peer].clone()), "peer", reason)
                }
                PeerDecision::Compute(_) => {
                    if uncached >= self.min_uncached_tokens() as usize {
                        self.metrics.prefill_demand.add(uncached as u64);
                    }
                    let (p, reason) = self
                        .place_prefill(uncached, ask, &routing, &mut decision_time)
                        .await;
                    let placement = if p.is_some() { "remote" } else { "local" };
                    (p, placement, reason)
                }
            };
        self.metrics.decision.observe(decision_time.as_secs_f64());
        self.metrics.placement(placement, placement_reason);
        routing.record("prefill_placement", placement);
        if prefill.is_none() {
            routing.record("prefill_reason", placement_reason);
        }
        if let Some(p) = &prefill {
            routing.record("prefill_worker", p.addr.as_str());
            span.record("prefill_worker", p.addr.as_str());
        }
        span.record("decode_worker", decode.addr.as_str());
        tracing::debug!(
            parent: &routing,
            decode = %decode.addr,
            prefill = ?prefill.as_ref().map(|p| &p.addr),
            "routed"
        );
        Ok(Picked {
            decode,
            prefill,
            uncached,
        })
    }

    /// Calls `decode`'s `Generate`. A worker that fails the call before
    /// streaming anything (it died since its last probe) is marked down and
    /// the call goes to another decode worker, once: nothing reached the
    /// client yet, so this is safe for every request. The stream, the
    /// worker that took the call and its load guard.
    async fn call_decode(
        &self,
        mut decode: Arc<Worker>,
        req: &v1::GenerateRequest,
        call: &Forward<'_>,
        blocks: usize,
    ) -> Result<
        (
            tonic::Streaming<v1::GenerateResponse>,
            Arc<Worker>,
            InFlight,
        ),
        Status,
    > {
        let mut retried = false;
        loop {
            let decode_load = InFlight::new(decode.clone(), blocks);
            let mut client = DecodeClient::new(decode.channel.clone());
            match client.generate(call.request(req.clone())?).await {
                Ok(r) => return Ok((r.into_inner(), decode, decode_load)),
                Err(status) if !retried && worker_failed(&status) => {
                    retried = true;
                    decode.mark_down();
                    let failed = decode.addr.clone();
                    let Some(next) = self.cluster.replacement(Role::Decode, &failed, &req.lora)
                    else {
                        return Err(upstream_status(&decode, status));
                    };
                    tracing::warn!(
                        parent: call.span,
                        from = %failed,
                        to = %next.addr,
                        error = %status.message(),
                        "decode worker refused the call; trying another"
                    );
                    call.span.record("decode_worker", next.addr.as_str());
                    decode = next;
                }
                Err(status) => return Err(upstream_status(&decode, status)),
            }
        }
    }
}

/// The workers a request goes to.
struct Picked {
    decode: Arc<Worker>,
    prefill: Option<Arc<Worker>>,
    /// Prompt tokens the decode worker does not cache.
    uncached: usize,
}

/// How a routed request is sent to its decode worker.
struct Forward<'a> {
    span: &'a tracing::Span,
    started: Instant,
    timeout: Option<Duration>,
    /// The remote prefill named in the call, if any.
    prefill: Option<wv1::PrefillPlacement>,
}

impl Forward<'_> {
    /// The call for `req`: its prefill worker, the trace context, and what
    /// is left of the client's deadline (the worker ends the stream itself
    /// when it passes).
    fn request(&self, req: v1::GenerateRequest) -> Result<Request<RoutedGenerateRequest>, Status> {
        let mut forward = Request::new(RoutedGenerateRequest {
            request: Some(req),
            prefill: self.prefill.clone(),
            resume: None,
        });
        tandem_telemetry::propagation::inject(self.span, forward.metadata_mut());
        if let Some(t) = self.timeout {
            let left = t.saturating_sub(self.started.elapsed());
            if left.is_zero() {
                return Err(Status::deadline_exceeded(
                    "the request's deadline (grpc-timeout) passed while routing",
                ));
            }
            forward.set_timeout(left);
        }
        Ok(forward)
    }
}

/// Names the chosen workers in `response`'s metadata.
fn name_workers(
    response: &mut Response<ResponseStream>,
    decode: &Worker,
    prefill: Option<&Worker>,
) {
    if let Ok(v) = MetadataValue::try_from(decode.addr.as_str()) {
        response.metadata_mut().insert(ROUTED_DECODE_HEADER, v);
    }
    if let Some(p) = prefill {
        if let Ok(v) = MetadataValue::try_from(p.addr.as_str()) {
            response.metadata_mut().insert(ROUTED_PREFILL_HEADER, v);
        }
    }
}
