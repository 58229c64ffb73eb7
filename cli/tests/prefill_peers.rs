//! Broken and forged prefill peers against a real decode worker (issue 26).
//! The peer here is a `Prefill` server in the test that holds the cluster
//! token (a compromised host, or a buggy prefill worker) and misbehaves in
//! one way per case:
//!
//! - it ends the transfer as done without writing a block: the decode
//!   worker must not take the never-written blocks as the prompt (nor cache
//!   them), but prefill locally;
//! - it replies "done" without ever finishing the transfer: the request
//!   must not stay parked for ever;
//! - it never answers, and the clients give up: every cancelled request
//!   retires its ticket and frees its blocks.
//!
//! And a real prefill worker whose clients cancel 10,000 remote prefills in
//! a loop: per-connection transfer state on both sides returns to zero and
//! the KV connection never fails.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_kv_transfer::tcp::TcpTransport;
use tandem_kv_transfer::{TransferId, Transport};
use tandem_proto::v1;
use tandem_proto::worker::v1 as wv1;
use tandem_tests::cluster::{free_port, greedy, runtime, Started};

const SECRET: &str = "prefill-peers-secret-4c1e";

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// How the fake prefill peer misbehaves.
#[derive(Debug, Clone, Copy)]
enum Peer {
    /// Finishes the transfer without writing, then replies "done".
    FinishesEmpty,
    /// Replies "done" without touching the transfer.
    RepliesOnly,
    /// Never replies.
    Silent,
}

#[tonic::async_trait]
impl wv1::prefill_server::Prefill for Peer {
    async fn prefill(
        &self,
        request: tonic::Request<wv1::PrefillRequest>,
    ) -> Result<tonic::Response<wv1::PrefillReply>, tonic::Status> {
        let req = request.into_inner();
        match self {
            Peer::Silent => std::future::pending::<()>().await,
            Peer::RepliesOnly => {}
            Peer::FinishesEmpty => {
                let layout = req
                    .layout
                    .as_ref()
                    .and_then(|l| tandem_server::layout::from_proto(l).ok())
                    .ok_or_else(|| tonic::Status::invalid_argument("layout"))?;
                let session = TcpTransport::new(SECRET)
                    .connect(&req.transfer_endpoint, layout)
                    .await
                    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                // The decode worker refuses this (that is the fix); the
                // reply claims success either way, as a forged peer would.
                let _ = session.finish(TransferId(req.transfer_id)).await;
            }
        }
        Ok(tonic::Response::new(wv1::PrefillReply {
            cached_tokens: 0,
            blocks_sent: u32::try_from(req.dst_blocks.len()).unwrap_or(u32::MAX),
            prompt_logprobs: Vec::new(),
        }))
    }
}

/// Serves `peer` on a loopback port; its address.
async fn serve_peer(peer: Peer) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wv1::prefill_server::PrefillServer::new(peer))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    addr
}

/// A decode worker serving `/metrics` on the returned address.
fn decode_worker(model: &Path) -> (Started, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let worker = tandem_tests::cluster::start_with_env(
        tandem(),
        &[
            "decode-worker",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "128",
            "--batch-invariant",
            "--metrics-addr",
            &metrics,
        ],
        &[("TANDEM_CLUSTER_TOKEN", SECRET)],
    );
    (worker, metrics)
}

/// A real prefill worker with the same cluster token, serving `/metrics` on
/// the returned address.
fn prefill_worker(model: &Path) -> (Started, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let worker = tandem_tests::cluster::start_with_env(
        tandem(),
        &[
            "prefill-worker",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "256",
            "--batch-invariant",
            "--metrics-addr",
            &metrics,
        ],
        &[("TANDEM_CLUSTER_TOKEN", SECRET)],
    );
    (worker, metrics)
}

/// The colocated reference, batch invariant like the worker.
fn serve(model: &Path) -> Started {
    tandem_tests::cluster::start(
        tandem(),
        &[
            "serve",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "128",
            "--batch-invariant",
        ],
    )
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 7 + salt) % 200).collect()
}

/// A greedy `Decode.Generate` on the decode worker, as the router sends
/// it: the cluster credential, and the prefill peer named in the typed
/// `prefill` placement (remote prefill from 8 uncached tokens).
fn call(prompt: &[u32], prefill: Option<&str>) -> tonic::Request<wv1::RoutedGenerateRequest> {
    tonic::Request::new(wv1::RoutedGenerateRequest {
        request: Some(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                ids: prompt.to_vec(),
            })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            max_tokens: Some(8),
            ignore_eos: true,
            ..Default::default()
        }),
        prefill: prefill.map(|worker| wv1::PrefillPlacement {
            worker: worker.to_string(),
            min_uncached_tokens: 8,
        }),
        resume: None,
    })
}

type Client =
    wv1::decode_client::DecodeClient<tandem_security::ClusterChannel<tonic::transport::Channel>>;

async fn client(addr: &str) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connects");
    wv1::decode_client::DecodeClient::new(
        tandem_security::ClusterCredential::derive(SECRET).channel(channel),
    )
}

/// The tokens and cached-token count of one call, within 30 s.
async fn run(
    client: &mut Client,
    req: tonic::Request<wv1::RoutedGenerateRequest>,
) -> (Vec<u32>, u32) {
    let answered = async {
        let mut stream = client.generate(req).await.expect("generate").into_inner();
        let (mut tokens, mut cached) = (Vec::new(), 0);
        while let Some(msg) = stream.message().await.expect("message") {
            match msg.event {
                Some(v1::generate_response::Event::Delta(d)) => tokens.extend(d.token_ids),
                Some(v1::generate_response::Event::Finished(f)) => {
                    cached = f.usage.map_or(0, |u| u.cached_tokens);
                }
                Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
            }
        }
        (tokens, cached)
    };
    tokio::time::timeout(Duration::from_secs(30), answered)
        .await
        .expect("the request hung on its prefill peer")
}

#[test]
fn a_peer_that_finishes_without_blocks_or_never_finishes_gets_a_local_prefill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let (decode, _) = decode_worker(&model);
    let reference = serve(&model);
    let rt = runtime();
    rt.block_on(async {
        let mut c = client(&decode.addr).await;
        for (salt, peer) in [(17, Peer::FinishesEmpty), (29, Peer::RepliesOnly)] {
            let long = prompt(200, salt);
            let want = greedy(&reference.addr, long.clone(), 8)
                .await
                .expect("reference")
                .tokens;
            let fake = serve_peer(peer).await;
            let (tokens, _) = run(&mut c, call(&long, Some(&fake))).await;
            assert_eq!(tokens, want, "{peer:?}: tokens after the transfer");
            // What the prefix cache now holds is the prompt's real K/V.
            let (tokens, cached) = run(&mut c, call(&long, None)).await;
            assert!(cached > 0, "{peer:?}: the second call reads the cache");
            assert_eq!(tokens, want, "{peer:?}: tokens from the cache");
        }
        let load = tandem_tests::cluster::load(&decode.addr).await;
        assert_eq!(load.parked, 0, "{load:?}");
    });
}

/// Clients that give up on requests parked behind a silent prefill peer
/// leave nothing behind: no open ticket (`tandem_kv_transfer_open_tickets`),
/// no parked sequence, every block free.
#[test]
fn cancelled_remote_prefills_leave_no_ticket_and_no_block() {
    const CANCELLED: usize = 40;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let (decode, metrics) = decode_worker(&model);
    let rt = runtime();
    rt.block_on(async {
        let fake = serve_peer(Peer::Silent).await;
        let mut c = client(&decode.addr).await;
        for i in 0..CANCELLED {
            let req = call(&prompt(100, i as u32), Some(&fake));
            let cut = tokio::time::timeout(Duration::from_millis(100), async {
                let mut stream = c.generate(req).await.expect("generate").into_inner();
                while stream.message().await.expect("message").is_some() {}
            })
            .await;
            assert!(cut.is_err(), "request {i} ended behind a silent peer");
        }
        let open = |m: &str| {
            tandem_tests::prometheus::scrape(m)
                .value("tandem_kv_transfer_open_tickets", &[])
                .expect("the open-tickets gauge")
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let load = tandem_tests::cluster::load(&decode.addr).await;
            let tickets = open(&metrics);
            if tickets == 0.0 && load.parked == 0 && load.free_blocks == load.num_blocks {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "after {CANCELLED} cancelled requests: {tickets} tickets open, {load:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// 10,000 remote prefills through a real prefill worker, each cancelled by
/// its client after 0.2 to 4 ms (before, during or just after its transfer;
/// 16 at a time): afterwards neither worker holds per-transfer state (open
/// transfers on either side of the KV connection, tickets, parked requests,
/// blocks), that connection never failed, and the next request still
/// prefills remotely. Before the prefill worker stopped writing on
/// cancellation, each cancelled transfer could reopen at the receiver until
/// the connection hit its open-transfer limit and failed.
#[test]
fn ten_thousand_cancelled_remote_prefills_leave_no_state_and_no_broken_connection() {
    const CANCELLED: usize = 10_000;
    const CONCURRENCY: usize = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let (decode, decode_metrics) = decode_worker(&model);
    let (prefill, prefill_metrics) = prefill_worker(&model);
    let rt = runtime();
    rt.block_on(async {
        let c = client(&decode.addr).await;
        let started = Instant::now();
        let mut clients = tokio::task::JoinSet::new();
        for first in 0..CONCURRENCY {
            let (mut c, target) = (c.clone(), prefill.addr.clone());
            clients.spawn(async move {
                let mut completed = 0usize;
                for i in (first..CANCELLED).step_by(CONCURRENCY) {
                    let cut_after = Duration::from_micros(200 + (i % 10) as u64 * 400);
                    let req = call(&prompt(64, i as u32), Some(&target));
                    let call = async {
                        let mut stream = c.generate(req).await.ok()?.into_inner();
                        while stream.message().await.ok()?.is_some() {}
                        Some(())
                    };
                    if let Ok(Some(())) = tokio::time::timeout(cut_after, call).await {
                        completed += 1;
                    }
                }
                completed
            });
        }
        let mut completed = 0;
        while let Some(done) = clients.join_next().await {
            completed += done.expect("client task");
        }
        let took = started.elapsed();
        let scrape = |m: &str| tandem_tests::prometheus::scrape(m);
        let open = |s: &tandem_tests::prometheus::Scrape, side: &str| {
            s.value("tandem_kv_transfer_open_transfers", &[("side", side)])
                .expect("the open-transfers gauge")
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (d, p) = (scrape(&decode_metrics), scrape(&prefill_metrics));
            let load = tandem_tests::cluster::load(&decode.addr).await;
            let tickets = d
                .value("tandem_kv_transfer_open_tickets", &[])
                .expect("tickets");
            let (receiving, sending) = (open(&d, "receive"), open(&p, "send"));
            if tickets == 0.0
                && receiving == 0.0
                && sending == 0.0
                && load.parked == 0
                && load.free_blocks == load.num_blocks
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "after {CANCELLED} cancelled calls: {tickets} tickets, {receiving} transfers \
                 open at the receiver, {sending} at the sender, {load:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let p = scrape(&prefill_metrics);
        let lost = p
            .value("tandem_kv_transfer_connections_lost_total", &[])
            .expect("connections lost");
        assert_eq!(lost, 0.0, "the KV connection failed");
        let cancelled_prefills = p
            .value("tandem_prefill_requests_total", &[("outcome", "cancelled")])
            .unwrap_or(0.0);
        eprintln!(
            "{CANCELLED} calls in {took:.1?}: {completed} completed before their cut, \
             {cancelled_prefills} prefill calls cancelled at the prefill worker"
        );
        assert!(
            cancelled_prefills >= (CANCELLED / 4) as f64,
            "only {cancelled_prefills} prefills were cancelled while the prefill worker held them"
        );
        // The connection still carries: the next call prefills remotely.
        let ok = |s: &tandem_tests::prometheus::Scrape| {
            s.value("tandem_remote_prefills_total", &[("outcome", "ok")])
                .unwrap_or(0.0)
        };
        let before = ok(&scrape(&decode_metrics));
        let mut c = c;
        let (tokens, _) = run(&mut c, call(&prompt(64, 1 << 20), Some(&prefill.addr))).await;
        assert_eq!(tokens.len(), 8);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ok(&scrape(&decode_metrics)) <= before {
            assert!(
                Instant::now() < deadline,
                "the last call was not prefilled remotely"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}
