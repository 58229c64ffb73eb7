//! The forwarded call's stream, and request migration.
//!
//! A [`Proxy`] owns the upstream stream from the decode worker and the load
//! guards; dropping it cancels the upstream call. When the decode worker
//! fails mid-stream (its process died, its connection broke), a request that
//! can be continued elsewhere is *migrated*: the proxy re-sends it to
//! another healthy decode worker with the tokens generated so far appended
//! to the prompt and `max_tokens` reduced by as many, and goes on streaming
//! from there, so the client's stream continues where it stopped. The
//! `Finished` message's usage is corrected back to the original prompt. At
//! most [`MAX_MIGRATIONS`] times per request, each within the request's
//! deadline.
//!
//! Every request migrates, and continues exactly: the continuation is the
//! original request (its prompt as sent, text or token ids: the new worker
//! tokenizes text the same way) plus a `Resume` with each choice's tokens
//! so far, which the new worker replays into each choice's grammar,
//! stop-string matcher, penalty counts and random stream (keyed by position:
//! a seeded choice draws what it would have drawn) before sampling on. A
//! choice that had ended is summarised, not generated again. Usage and
//! timings in the `Finished` message count the whole request once. A
//! request whose stream had sent nothing yet (beam search sends everything
//! at its end) is simply sent again; beam search that had begun to stream
//! its results does not migrate.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1;
use tandem_proto::worker::v1::decode_client::DecodeClient;
use tandem_proto::worker::v1::{self as wv1, RoutedGenerateRequest};
use tonic::{Code, Request, Status, Streaming};

use crate::metrics::RouterMetrics;
use crate::pool::{Cluster, InFlight, Role, Worker};

/// Migrations one request may go through.
pub const MAX_MIGRATIONS: u32 = 2;

/// What a call needs to continue on another decode worker.
pub(crate) struct Resume {
    pub(crate) cluster: Arc<Cluster>,
    /// The request as first forwarded (token-id prompt), without routing
    /// metadata.
    pub(crate) request: v1::GenerateRequest,
    pub(crate) deadline: Option<Instant>,
    pub(crate) block_size: usize,
    /// When the router first forwarded it.
    pub(crate) started: Instant,
    /// When its first token arrived.
    pub(crate) first_token: Option<Instant>,
    /// Whether any message reached the client (then a beam search cannot
    /// restart, and the prompt's scores were sent).
    pub(crate) streamed: bool,
    /// Each choice's tokens so far, by index.
    pub(crate) tokens: BTreeMap<u32, Vec<u32>>,
    pub(crate) attempts_left: u32,
    /// A pull's placement threshold (the router's remote-prefill one).
    pub(crate) min_uncached_tokens: u32,
}

impl Resume {
    /// What `request` needs to continue elsewhere (see the module doc).
    pub(crate) fn for_request(
        cluster: Arc<Cluster>,
        request: &v1::GenerateRequest,
        deadline: Option<Instant>,
        block_size: usize,
        min_uncached_tokens: u32,
    ) -> Resume {
        Resume {
            cluster,
            request: request.clone(),
            deadline,
            block_size,
            started: Instant::now(),
            first_token: None,
            streamed: false,
            tokens: BTreeMap::new(),
            attempts_left: MAX_MIGRATIONS,
            min_uncached_tokens,
        }
    }

    /// The request that continues this one and where it stands: the
    /// original request as is when nothing was streamed yet; `None` when it
    /// cannot go on (a beam search that had begun to stream).
    fn continuation(&self) -> Option<(v1::GenerateRequest, Option<wv1::Resume>)> {
        if !self.streamed {
            return Some((self.request.clone(), None));
        }
        if self.request.beam_search.is_some() {
            return None;
        }
        let mut req = self.request.clone();
        // The prompt's scores came before the first token: the client has
        // them.
        req.prompt_logprobs = None;
        let resume = wv1::Resume {
            choices: self
                .tokens
                .iter()
                .map(|(&index, tokens)| wv1::ResumedChoice {
                    index,
                    token_ids: tokens.clone(),
                })
                .collect(),
            elapsed_s: self.started.elapsed().as_secs_f64(),
            first_token_s: self
                .first_token
                .map(|t| t.duration_since(self.started).as_secs_f64()),
        };
        Some((req, Some(resume)))
    }

    /// Records what the client got.
    fn track(&mut self, msg: &v1::GenerateResponse) {
        self.streamed = true;
        if let Some(v1::generate_response::Event::Delta(d)) = &msg.event {
            if !d.token_ids.is_empty() && self.first_token.is_none() {
                self.first_token = Some(Instant::now());
            }
            self.tokens
                .entry(d.index)
                .or_default()
                .extend_from_slice(&d.token_ids);
        }
    }

    /// Tokens in the continuation's prompt and replay (for the load count;
    /// a text prompt counts as the characters' quarter, about its tokens).
    fn tokens_to_compute(&self) -> usize {
        let prompt = match &self.request.prompt {
            Some(v1::generate_request::Prompt::TokenIds(ids)) => ids.ids.len(),
            Some(v1::generate_request::Prompt::Text(text)) => text.len() / 4,
            None => 0,
        };
        prompt + self.tokens.values().map(Vec::len).max().unwrap_or(0)
    }
}

/// Why a request migrates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// Its decode worker failed (died, lost its connection): the KV is
    /// gone with it.
    Failure,
    /// Its decode worker is draining and handed it over, keeping its KV.
    Drain,
}

impl Cause {
    fn label(self) -> &'static str {
        match self {
            Cause::Failure => "failure",
            Cause::Drain => "drain",
        }
    }
}

/// The forwarded call; dropping it cancels the upstream call and releases
/// the load counters.
pub(crate) struct Proxy {
    pub(crate) upstream: Streaming<v1::GenerateResponse>,
    pub(crate) decode: Arc<Worker>,
    pub(crate) decode_load: InFlight,
    /// Released at the first token: prefill is over by then.
    pub(crate) prefill_load: Option<InFlight>,
    pub(crate) ended: bool,
    /// The call's span: ends with the stream.
    pub(crate) span: tracing::Span,
    pub(crate) metrics: Arc<RouterMetrics>,
    pub(crate) started: Instant,
    /// When the first message came (the TTFT), for the TPOT at the end.
    pub(crate) first_token: Option<Instant>,
    /// Tokens streamed so far, every choice's.
    pub(crate) generated: u64,
    /// Taken while a migration runs.
    pub(crate) resume: Option<Resume>,
}

impl Proxy {
    fn count_tokens(&mut self, msg: &v1::GenerateResponse) {
        if let Some(v1::generate_response::Event::Delta(d)) = &msg.event {
            let n = d.token_ids.len() as u64;
            self.generated += n;
            self.metrics.generation_tokens.add(n);
        }
    }

    /// The finished request's time per output token after the first.
    fn observe_tpot(&self) {
        if let Some(first) = self.first_token.filter(|_| self.generated > 1) {
            let per_token = first.elapsed().as_secs_f64() / (self.generated - 1) as f64;
            self.metrics.tpot.observe(per_token);
        }
    }

    fn end(&mut self, outcome: &'static str) {
        self.ended = true;
        self.metrics.request(outcome);
        self.span.record("outcome", outcome);
    }

    pub(crate) async fn next(&mut self) -> Option<Result<v1::GenerateResponse, Status>> {
        if self.ended {
            return None;
        }
        loop {
            match self.upstream.message().await {
                Ok(Some(msg)) => {
                    self.prefill_load = None;
                    if self.first_token.is_none() {
                        self.first_token = Some(Instant::now());
                        self.metrics.ttft.observe_duration(self.started.elapsed());
                    }
                    self.count_tokens(&msg);
                    if let Some(resume) = &mut self.resume {
                        resume.track(&msg);
                    }
                    return Some(Ok(msg));
                }
                Ok(None) => {
                    self.metrics.e2e.observe_duration(self.started.elapsed());
                    self.observe_tpot();
                    self.end("finished");
                    return None;
                }
                Err(status) => {
                    tracing::warn!(
                        parent: &self.span,
                        decode = %self.decode.addr,
                        error = %status.message(),
                        "decode worker failed the request"
                    );
                    let cause = if tandem_proto::worker::is_handed_over(&status) {
                        Cause::Drain
                    } else {
                        Cause::Failure
                    };
                    // A replacement's own refusal (its queue is full, the
                    // deadline passed) is what the client should hear, not
                    // the hand-over it tried to continue.
                    let status = match worker_failed(&status) {
                        true => match self.migrate(cause).await {
                            Ok(()) => continue,
                            Err(refusal) => refusal.unwrap_or(status),
                        },
                        false => status,
                    };
                    self.end(outcome_of(&status));
                    return Some(Err(upstream_status(&self.decode, status)));
                }
            }
        }
    }

    /// Re-sends the request to another decode worker: `Ok` when the stream
    /// now comes from there; else the replacement's refusal, if one
    /// answered with one.
    async fn migrate(&mut self, cause: Cause) -> Result<(), Option<Status>> {
        let Some(mut resume) = self.resume.take() else {
            return Err(None);
        };
        self.decode.mark_down();
        // A draining worker keeps the request's blocks for the taking: the
        // next worker pulls them from it like from a prefill worker.
        let kv_source = match cause {
            Cause::Drain => Some(self.decode.addr.clone()),
            Cause::Failure => None,
        };
        let moved = self.migrate_with(&mut resume, cause, kv_source).await;
        self.resume = Some(resume);
        moved
    }

    async fn migrate_with(
        &mut self,
        resume: &mut Resume,
        cause: Cause,
        kv_source: Option<String>,
    ) -> Result<(), Option<Status>> {
        let path = if kv_source.is_some() {
            "kv_moved"
        } else {
            "reprefilled"
        };
        while resume.attempts_left > 0 {
            resume.attempts_left -= 1;
            let Some((req, replay)) = resume.continuation() else {
                self.metrics
                    .migration(cause.label(), "cannot_resume", "none");
                return Err(None);
            };
            let failed = self.decode.addr.clone();
            let Some(next) = resume.cluster.replacement(Role::Decode, &failed, &req.lora) else {
                self.metrics.migration(cause.label(), "no_worker", "none");
                return Err(None);
            };
            let prompt_len = resume.tokens_to_compute();
            // Without a KV source the continuation computes its prompt and
            // replayed tokens where it lands: mostly cached nowhere.
            let mut forward = Request::new(RoutedGenerateRequest {
                request: Some(req),
                prefill: kv_source.clone().map(|worker| wv1::PrefillPlacement {
                    worker,
                    min_uncached_tokens: resume.min_uncached_tokens,
                }),
                resume: replay,
            });
            tandem_telemetry::propagation::inject(&self.span, forward.metadata_mut());
            if let Some(deadline) = resume.deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(None);
                }
                forward.set_timeout(left);
            }
            let load = InFlight::new(next.clone(), prompt_len.div_ceil(resume.block_size));
            let mut client = DecodeClient::new(next.channel.clone());
            match client.generate(forward).await {
                Ok(response) => {
                    tracing::info!(
                        parent: &self.span,
                        from = %failed,
                        to = %next.addr,
                        tokens_so_far = resume.tokens.values().map(Vec::len).sum::<usize>(),
                        "request migrated"
                    );
                    self.metrics.migration(cause.label(), "resumed", path);
                    self.upstream = response.into_inner();
                    self.decode = next;
                    self.decode_load = load;
                    return Ok(());
                }
                Err(status) => {
                    tracing::warn!(
                        parent: &self.span,
                        to = %next.addr,
                        error = %status.message(),
                        "migrating the request failed"
                    );
                    if worker_failed(&status) {
                        next.mark_down();
                    } else {
                        return Err(Some(status));
                    }
                }
            }
        }
        Err(None)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if !self.ended {
            self.end("cancelled");
        }
    }
}

/// Whether `status` means the worker (not the request) failed: the
/// transport's errors and the worker's own, never one the worker scoped to
/// the request (`tandem_proto::worker::is_request_error`).
pub(crate) fn worker_failed(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Internal
    ) && !tandem_proto::worker::is_request_error(status)
}

/// What the client sees of a decode worker's error. The request's own
/// verdicts pass through with their metadata (a bad argument, a full queue
/// with its `retry-after`, a passed deadline); anything else means the
/// worker failed: it is marked down if it looks gone, and the client gets
/// UNAVAILABLE naming it.
pub(crate) fn upstream_status(decode: &Worker, status: Status) -> Status {
    match status.code() {
        Code::InvalidArgument | Code::ResourceExhausted | Code::DeadlineExceeded => status,
        _ if tandem_proto::worker::is_request_error(&status) => status,
        _ => {
            if worker_failed(&status) {
                decode.mark_down();
            }
            Status::unavailable(format!(
                "decode worker {}: {}",
                decode.addr,
                status.message()
            ))
        }
    }
}

/// The `outcome` label of a request that ended with `status`.
pub(crate) fn outcome_of(status: &Status) -> &'static str {
    match status.code() {
        Code::InvalidArgument => "invalid",
        Code::ResourceExhausted => "overloaded",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Unavailable => "unavailable",
        _ => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_request_scoped_error_does_not_fail_the_worker() {
        let internal = Status::internal("KV cache exhausted for this request");
        assert!(worker_failed(&internal));
        let scoped = tandem_proto::worker::request_error(internal);
        assert!(!worker_failed(&scoped));
        assert!(worker_failed(&Status::unavailable("connection refused")));
        assert!(!worker_failed(&Status::invalid_argument("bad")));
    }

    fn request(ids: Vec<u32>, max_tokens: Option<u32>) -> v1::GenerateRequest {
        v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
            max_tokens,
            ..Default::default()
        }
    }

    fn resume(req: &v1::GenerateRequest) -> Resume {
        Resume::for_request(Cluster::new(Duration::from_millis(100)), req, None, 16, 1)
    }

    fn delta(index: u32, token_ids: Vec<u32>) -> v1::GenerateResponse {
        v1::GenerateResponse {
            event: Some(v1::generate_response::Event::Delta(v1::TokenDelta {
                index,
                token_ids,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn the_continuation_is_the_original_request_and_each_choices_tokens() {
        let mut original = request(vec![5, 6, 7], Some(10));
        original.n = 2;
        original.prompt_logprobs = Some(1);
        let mut r = resume(&original);
        // Nothing streamed yet: sent again as it was.
        let (again, replay) = r.continuation().expect("continues");
        assert_eq!(again, original);
        assert!(replay.is_none());
        for msg in [delta(0, vec![8, 9]), delta(1, vec![4]), delta(0, vec![3])] {
            r.track(&msg);
        }
        let (next, replay) = r.continuation().expect("continues");
        let replay = replay.expect("a resume");
        assert_eq!(
            next.prompt, original.prompt,
            "the prompt stays the original"
        );
        assert_eq!(next.max_tokens, Some(10));
        assert_eq!(next.prompt_logprobs, None, "the prompt's scores were sent");
        let choices: Vec<(u32, Vec<u32>)> = replay
            .choices
            .into_iter()
            .map(|c| (c.index, c.token_ids))
            .collect();
        assert_eq!(choices, vec![(0, vec![8, 9, 3]), (1, vec![4])]);
        assert!(replay.first_token_s.is_some());
        assert_eq!(r.tokens_to_compute(), 6);
        // A text prompt goes as it was: the new worker tokenizes it alike.
        let mut text = request(vec![], Some(4));
        text.prompt = Some(v1::generate_request::Prompt::Text("Hi".into()));
        let mut t = resume(&text);
        t.track(&delta(0, vec![1]));
        let (next, replay) = t.continuation().expect("continues");
        assert_eq!(next.prompt, text.prompt);
        assert_eq!(replay.map(|r| r.choices.len()), Some(1));
        // A beam search that began to stream cannot start over.
        let mut beams = request(vec![1], Some(4));
        beams.beam_search = Some(v1::BeamSearch::default());
        let mut b = resume(&beams);
        assert!(b.continuation().is_some_and(|c| c.1.is_none()));
        b.track(&delta(0, vec![1, 2]));
        assert!(b.continuation().is_none());
    }
}
