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
//! What can migrate: one choice, token-id prompts (the router tokenizes text
//! prompts when it has the tokenizer), no `response_format` (the grammar's
//! state lives in the failed worker), no stop strings (text held back for a
//! possible match would be lost) and no presence/frequency penalty (those
//! count generated tokens, which become prompt tokens), no beam search
//! (beams live in the failed worker and nothing of them has streamed: a
//! continuation would search from one hypothesis). Greedy requests
//! continue with the same tokens; a seeded sampled request continues as a
//! valid sample but not the one it would have drawn.

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1;
use tandem_proto::worker::v1::decode_client::DecodeClient;
use tandem_proto::worker::v1::RoutedGenerateRequest;
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
    /// Tokens streamed so far (choice 0).
    pub(crate) generated: Vec<u32>,
    /// How many of them the current upstream got as prompt.
    pub(crate) carried: u32,
    pub(crate) attempts_left: u32,
}

impl Resume {
    /// `Some` when `request` can be migrated (see the module doc).
    pub(crate) fn for_request(
        cluster: Arc<Cluster>,
        request: &v1::GenerateRequest,
        deadline: Option<Instant>,
        block_size: usize,
    ) -> Option<Resume> {
        let sampling = request.sampling.unwrap_or_default();
        let migratable = request.n <= 1
            && matches!(
                request.prompt,
                Some(v1::generate_request::Prompt::TokenIds(_))
            )
            && request.response_format.is_none()
            && request.beam_search.is_none()
            && request.stop.is_empty()
            && sampling.presence_penalty == 0.0
            && sampling.frequency_penalty == 0.0;
        migratable.then(|| Resume {
            cluster,
            request: request.clone(),
            deadline,
            block_size,
            generated: Vec::new(),
            carried: 0,
            attempts_left: MAX_MIGRATIONS,
        })
    }

    /// The request that continues this one: the prompt plus what was
    /// generated, for the tokens still to come.
    fn continuation(&self) -> Option<v1::GenerateRequest> {
        let mut req = self.request.clone();
        let Some(v1::generate_request::Prompt::TokenIds(ids)) = &mut req.prompt else {
            return None;
        };
        // Prompt scores come before the first token: with tokens generated
        // the client has them, and the longer prompt must not be scored.
        if !self.generated.is_empty() {
            req.prompt_logprobs = None;
        }
        ids.ids.extend_from_slice(&self.generated);
        if let Some(max) = req.max_tokens {
            let left = max.checked_sub(self.generated.len() as u32)?;
            if left == 0 {
                return None;
            }
            req.max_tokens = Some(left);
        }
        Some(req)
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
    pub(crate) first_seen: bool,
    /// `None` for requests that cannot migrate.
    pub(crate) resume: Option<Resume>,
}

impl Proxy {
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
                Ok(Some(mut msg)) => {
                    self.prefill_load = None;
                    if !self.first_seen {
                        self.first_seen = true;
                        self.metrics.ttft.observe_duration(self.started.elapsed());
                    }
                    if let Some(resume) = &mut self.resume {
                        track(resume, &mut msg);
                    }
                    return Some(Ok(msg));
                }
                Ok(None) => {
                    self.metrics.e2e.observe_duration(self.started.elapsed());
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
                    if worker_failed(&status) && self.migrate().await {
                        continue;
                    }
                    self.end(outcome_of(&status));
                    return Some(Err(upstream_status(&self.decode, status)));
                }
            }
        }
    }

    /// Re-sends the request to another decode worker; true when the stream
    /// now comes from there.
    async fn migrate(&mut self) -> bool {
        let Some(mut resume) = self.resume.take() else {
            return false;
        };
        self.decode.mark_down();
        let moved = self.migrate_with(&mut resume).await;
        self.resume = Some(resume);
        moved
    }

    async fn migrate_with(&mut self, resume: &mut Resume) -> bool {
        while resume.attempts_left > 0 {
            resume.attempts_left -= 1;
            let Some(req) = resume.continuation() else {
                return false;
            };
            let failed = self.decode.addr.clone();
            let Some(next) = resume.cluster.replacement(Role::Decode, &failed, &req.lora) else {
                self.metrics.migration("no_worker");
                return false;
            };
            let prompt_len = match &req.prompt {
                Some(v1::generate_request::Prompt::TokenIds(ids)) => ids.ids.len(),
                _ => 0,
            };
            // The continuation prefills where it lands: its prompt is the
            // original one plus what was generated, mostly cached nowhere.
            let mut forward = Request::new(RoutedGenerateRequest {
                request: Some(req),
                prefill_worker: String::new(),
            });
            tandem_telemetry::propagation::inject(&self.span, forward.metadata_mut());
            if let Some(deadline) = resume.deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return false;
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
                        tokens_so_far = resume.generated.len(),
                        "request migrated"
                    );
                    self.metrics.migration("resumed");
                    resume.carried = resume.generated.len() as u32;
                    self.upstream = response.into_inner();
                    self.decode = next;
                    self.decode_load = load;
                    return true;
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
                        return false;
                    }
                }
            }
        }
        false
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if !self.ended {
            self.end("cancelled");
        }
    }
}

/// Records the tokens of choice 0 and, after a migration, gives the
/// `Finished` usage back in terms of the original request.
fn track(resume: &mut Resume, msg: &mut v1::GenerateResponse) {
    match &mut msg.event {
        Some(v1::generate_response::Event::Delta(d)) if d.index == 0 => {
            resume.generated.extend_from_slice(&d.token_ids);
        }
        Some(v1::generate_response::Event::Finished(f)) if resume.carried > 0 => {
            let carried = resume.carried;
            if let Some(u) = &mut f.usage {
                u.prompt_tokens = u.prompt_tokens.saturating_sub(carried);
                u.cached_tokens = u.cached_tokens.min(u.prompt_tokens);
                u.completion_tokens += carried;
            }
            for c in &mut f.choices {
                c.completion_tokens += carried;
            }
        }
        _ => {}
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

    fn resume(req: &v1::GenerateRequest) -> Option<Resume> {
        Resume::for_request(Cluster::new(Duration::from_millis(100)), req, None, 16)
    }

    #[test]
    fn what_cannot_continue_elsewhere_does_not_migrate() {
        assert!(resume(&request(vec![1, 2], Some(8))).is_some());
        let mut r = request(vec![1, 2], Some(8));
        r.n = 2;
        assert!(resume(&r).is_none(), "several choices");
        let mut r = request(vec![1, 2], Some(8));
        r.stop = vec!["\n".into()];
        assert!(resume(&r).is_none(), "stop strings");
        let mut r = request(vec![1, 2], Some(8));
        r.response_format = Some(v1::ResponseFormat::default());
        assert!(resume(&r).is_none(), "a grammar");
        let mut r = request(vec![1, 2], Some(8));
        r.sampling = Some(v1::SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        });
        assert!(resume(&r).is_none(), "a presence penalty");
        let mut r = request(vec![], Some(8));
        r.prompt = Some(v1::generate_request::Prompt::Text("hi".into()));
        assert!(resume(&r).is_none(), "an untokenized prompt");
    }

    #[test]
    fn the_continuation_carries_the_tokens_and_the_usage_comes_back() {
        let mut r = resume(&request(vec![5, 6, 7], Some(10))).expect("migratable");
        let mut delta = v1::GenerateResponse {
            event: Some(v1::generate_response::Event::Delta(v1::TokenDelta {
                token_ids: vec![8, 9],
                ..Default::default()
            })),
            ..Default::default()
        };
        track(&mut r, &mut delta);
        let next = r.continuation().expect("tokens are left");
        assert_eq!(next.max_tokens, Some(8));
        let Some(v1::generate_response::Event::Delta(_)) = delta.event else {
            panic!("deltas pass through unchanged");
        };
        match next.prompt {
            Some(v1::generate_request::Prompt::TokenIds(ids)) => {
                assert_eq!(ids.ids, vec![5, 6, 7, 8, 9]);
            }
            other => panic!("{other:?}"),
        }
        r.carried = 2;
        let mut finished = v1::GenerateResponse {
            event: Some(v1::generate_response::Event::Finished(v1::Finished {
                usage: Some(v1::Usage {
                    prompt_tokens: 5,
                    cached_tokens: 5,
                    completion_tokens: 8,
                }),
                choices: vec![v1::ChoiceSummary {
                    completion_tokens: 8,
                    ..Default::default()
                }],
                ..Default::default()
            })),
            ..Default::default()
        };
        track(&mut r, &mut finished);
        let Some(v1::generate_response::Event::Finished(f)) = finished.event else {
            panic!("finished");
        };
        let u = f.usage.expect("usage");
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (3, 3, 10)
        );
        assert_eq!(f.choices[0].completion_tokens, 10);
        // Nothing left to generate: nothing to migrate.
        r.generated = vec![1; 10];
        assert!(r.continuation().is_none());
    }
}
