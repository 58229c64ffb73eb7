//! Sends a workload to a `tandem.v1.Generation` server and records every
//! request's timings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tonic::transport::Channel;

use crate::arrival::Arrival;
use crate::metrics::RequestRecord;
use crate::workload::{Prompt, WorkItem};
use crate::LoadgenError;

/// How to run a workload.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub arrival: Arrival,
    /// Stop sending after this long (requests in flight still finish).
    pub max_duration: Option<Duration>,
    /// A request still running after this long is cancelled and failed.
    pub request_timeout: Duration,
    /// Sampling temperature (`None`: the server's default).
    pub temperature: Option<f32>,
    pub seed: u64,
    /// Told of every request as it ends (a progress bar); `None` for none.
    pub observer: Option<Arc<dyn RunObserver>>,
}

/// Watches a run as it goes: the command line draws a progress bar with
/// live TTFT / TPOT / throughput from these calls.
pub trait RunObserver: Send + Sync + std::fmt::Debug {
    /// The next runs are `label`'s (a sweep names each rate's run).
    fn phase(&self, label: &str) {
        let _ = label;
    }
    /// A run of at most `total` requests begins.
    fn started(&self, total: usize);
    /// One request ended (completed or failed); called from the task that
    /// sent it.
    fn finished(&self, record: &RequestRecord);
}

/// Connects to `addr` (`host:port`).
pub async fn connect(addr: &str) -> Result<Channel, LoadgenError> {
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| LoadgenError::Connect(format!("{addr}: {e}")))?;
    endpoint
        .connect()
        .await
        .map_err(|e| LoadgenError::Connect(format!("{addr}: {e}")))
}

/// Sends `items` as `opts` says and returns one record per request sent,
/// in sending order.
pub async fn run(channel: Channel, items: Vec<WorkItem>, opts: &RunOptions) -> Vec<RequestRecord> {
    let start = Instant::now();
    if let Some(o) = &opts.observer {
        o.started(items.len());
    }
    let deadline = opts.max_duration.map(|d| start + d);
    let items = Arc::new(items);
    let mut records: Vec<(usize, RequestRecord)> = Vec::new();
    match opts.arrival.schedule(items.len(), opts.seed) {
        Some(offsets) => {
            let mut tasks = Vec::new();
            for (i, offset) in offsets.into_iter().enumerate() {
                let at = start + Duration::from_secs_f64(offset);
                if deadline.is_some_and(|d| at > d) {
                    break;
                }
                tokio::time::sleep_until(at.into()).await;
                let (channel, items, opts) = (channel.clone(), items.clone(), opts.clone());
                tasks.push(tokio::spawn(async move {
                    let r = one(channel, &items[i], start, &opts).await;
                    (i, r)
                }));
            }
            for t in tasks {
                if let Ok(r) = t.await {
                    records.push(r);
                }
            }
        }
        None => {
            let Arrival::Concurrency(n) = opts.arrival else {
                unreachable!("schedule() is None only for a closed loop")
            };
            let next = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..n.max(1))
                .map(|_| {
                    let (channel, items, next, opts) =
                        (channel.clone(), items.clone(), next.clone(), opts.clone());
                    tokio::spawn(async move {
                        let mut out = Vec::new();
                        loop {
                            if deadline.is_some_and(|d| Instant::now() > d) {
                                break;
                            }
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(item) = items.get(i) else { break };
                            out.push((i, one(channel.clone(), item, start, &opts).await));
                        }
                        out
                    })
                })
                .collect();
            for w in workers {
                if let Ok(rs) = w.await {
                    records.extend(rs);
                }
            }
        }
    }
    records.sort_by_key(|(i, _)| *i);
    records.into_iter().map(|(_, r)| r).collect()
}

/// Sends one request and times it.
async fn one(
    channel: Channel,
    item: &WorkItem,
    start: Instant,
    opts: &RunOptions,
) -> RequestRecord {
    let sent = Instant::now();
    let mut rec = RequestRecord {
        sent_at: sent.duration_since(start).as_secs_f64(),
        ..RequestRecord::default()
    };
    let prompt = match &item.prompt {
        Prompt::Tokens(t) => {
            rec.input_tokens = t.len() as u32;
            v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: t.clone() })
        }
        Prompt::Text(s) => v1::generate_request::Prompt::Text(s.clone()),
    };
    let req = v1::GenerateRequest {
        prompt: Some(prompt),
        max_tokens: Some(item.max_tokens),
        ignore_eos: true,
        sampling: Some(v1::SamplingParams {
            temperature: opts.temperature,
            ..Default::default()
        }),
        ..Default::default()
    };
    let outcome = tokio::time::timeout(opts.request_timeout, async {
        let mut client = GenerationClient::new(channel);
        let mut stream = client.generate(req).await?.into_inner();
        let mut last = sent;
        while let Some(msg) = stream.message().await? {
            match msg.event {
                Some(v1::generate_response::Event::Delta(d)) if !d.token_ids.is_empty() => {
                    let now = Instant::now();
                    if rec.ttft.is_none() {
                        rec.ttft = Some(now.duration_since(sent).as_secs_f64());
                    } else {
                        rec.itls.push(now.duration_since(last).as_secs_f64());
                    }
                    last = now;
                    rec.output_tokens += d.token_ids.len() as u32;
                }
                Some(v1::generate_response::Event::Finished(f)) => {
                    if let Some(u) = f.usage {
                        rec.input_tokens = u.prompt_tokens;
                    }
                }
                _ => {}
            }
        }
        Ok::<(), tonic::Status>(())
    })
    .await;
    rec.e2e = sent.elapsed().as_secs_f64();
    rec.error = match outcome {
        Ok(Ok(())) if rec.ttft.is_some() => None,
        Ok(Ok(())) => Some("no tokens".into()),
        Ok(Err(status)) => Some(format!("{:?}: {}", status.code(), status.message())),
        Err(_) => Some(format!("timed out after {:?}", opts.request_timeout)),
    };
    if let Some(o) = &opts.observer {
        o.finished(&rec);
    }
    rec
}
