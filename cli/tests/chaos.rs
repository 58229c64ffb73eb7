//! Chaos under load: a cluster of separate processes (etcd, a router, two
//! prefill and three decode workers) serves a steady stream of requests
//! while a prefill worker and a decode worker are killed (SIGKILL), etcd is
//! frozen (SIGSTOP) and thawed, the router is killed and started again on
//! the same port, and then the last prefill worker and a decode worker are
//! frozen together for a while and thawed.
//!
//! The clients set no deadline. Every request must end: it completes
//! (those in flight at a killed or frozen decode worker migrate to another
//! one; those parked behind the frozen prefill worker are prefilled
//! locally after the decode worker's prefill wait), or fails with a gRPC
//! status (the ones in flight at the killed router, or sent while no router
//! listens). None may be open 30 s after it was sent (`hung`), and once the
//! load stops, every surviving worker must hold no KV block, have nothing
//! running, waiting or parked, and the decode workers no open transfer
//! ticket. The figures are printed (`chaos: ...`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_tests::cluster::{free_port, load, runtime, spawn_component, KillOnDrop};
use tandem_tests::etcd::EtcdServer;

/// Requests per second, and for how long.
const RATE: u64 = 20;
const LOAD_SECONDS: u64 = 40;
/// A call still open this long after it was sent hangs (the clients set
/// no gRPC deadline: the cluster's own bounds must end every call).
const HUNG_AFTER: Duration = Duration::from_secs(30);
/// The request that is streaming when its decode worker dies.
const LONG_TOKENS: u32 = 400;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// How a request ended: `ok`, a gRPC code's name, or `hung`.
async fn one(router: String, i: u64) -> String {
    let call = async {
        let mut c = GenerationClient::connect(format!("http://{router}"))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let ids: Vec<u32> = (0..24 + (i % 16) as u32)
            .map(|j| (i as u32 * 37 + j * 11) % 250 + 1)
            .collect();
        let req = tonic::Request::new(v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            // Every tenth request is long, so some are mid-stream when a
            // decode worker dies.
            max_tokens: Some(if i.is_multiple_of(10) { 300 } else { 12 }),
            ignore_eos: true,
            ..Default::default()
        });
        let mut stream = c.generate(req).await?.into_inner();
        let mut finished = false;
        while let Some(msg) = stream.message().await? {
            finished |= matches!(msg.event, Some(v1::generate_response::Event::Finished(_)));
        }
        if finished {
            Ok(())
        } else {
            Err(tonic::Status::internal("the stream ended without Finished"))
        }
    };
    match tokio::time::timeout(HUNG_AFTER, call).await {
        Ok(Ok(())) => "ok".to_string(),
        Ok(Err(status)) => format!("{:?}", status.code()),
        Err(_) => "hung".to_string(),
    }
}

#[test]
fn the_cluster_keeps_answering_through_kills_an_etcd_freeze_and_a_router_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny");
    let model = tmp.path().to_str().expect("utf8").to_string();
    let etcd = EtcdServer::start().expect("etcd");
    let etcd_url = etcd.endpoint();
    let cluster = "chaos";
    let worker_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--model",
            &model,
            "--addr",
            "127.0.0.1:0",
            "--etcd",
            &etcd_url,
            "--cluster",
            cluster,
            "--lease-ttl-s",
            "2",
            "--kv-cache-memory",
            "32MiB",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // (process, gRPC address, metrics address)
    let start = |role: &str| {
        let metrics = format!("127.0.0.1:{}", free_port());
        let args = worker_args(&["--metrics-addr", &metrics]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (process, addr) = spawn_component(tandem(), role, &args);
        (process, addr, metrics)
    };
    let mut prefills = vec![start("prefill-worker"), start("prefill-worker")];
    let mut decodes = vec![
        start("decode-worker"),
        start("decode-worker"),
        start("decode-worker"),
    ];
    let router_addr = format!("127.0.0.1:{}", free_port());
    let router_metrics = format!("127.0.0.1:{}", free_port());
    let start_router = || {
        spawn_component(
            tandem(),
            "router",
            &[
                "--addr",
                &router_addr,
                "--model",
                &model,
                "--etcd",
                &etcd_url,
                "--cluster",
                cluster,
                "--remote-prefill-threshold",
                "8",
                "--metrics-addr",
                &router_metrics,
            ],
        )
    };
    let (router, addr) = start_router();
    assert_eq!(addr, router_addr);
    let mut router: Option<KillOnDrop> = Some(router);

    let outcomes: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let rt = runtime();
    let load_task = {
        let outcomes = outcomes.clone();
        let addr = router_addr.clone();
        rt.spawn(async move {
            let mut calls = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
            for i in 0..RATE * LOAD_SECONDS {
                tick.tick().await;
                let (outcomes, addr) = (outcomes.clone(), addr.clone());
                calls.spawn(async move {
                    let end = one(addr, i).await;
                    *outcomes
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .entry(end)
                        .or_default() += 1;
                });
            }
            while calls.join_next().await.is_some() {}
        })
    };

    // The chaos, on a schedule from the start of the load.
    let t0 = Instant::now();
    let at = |s: u64| {
        let when = t0 + Duration::from_secs(s);
        std::thread::sleep(when.saturating_duration_since(Instant::now()));
    };
    at(6);
    let (victim, _, _) = prefills.remove(0);
    signal("-KILL", victim.0.id());
    drop(victim);
    at(12);
    // A long request is streaming when its decode worker is killed: it must
    // migrate to the other one and deliver every token.
    let (long_stream, victim_addr, first_tokens) = rt.block_on(async {
        let mut c = GenerationClient::connect(format!("http://{router_addr}"))
            .await
            .expect("router");
        let resp = c
            .generate(v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                    ids: (1..30).collect(),
                })),
                max_tokens: Some(LONG_TOKENS),
                ignore_eos: true,
                ..Default::default()
            })
            .await
            .expect("the long call");
        let routed = resp
            .metadata()
            .get(tandem_proto::worker::ROUTED_DECODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .expect("routed")
            .to_string();
        let mut stream = resp.into_inner();
        let first = match stream
            .message()
            .await
            .expect("a message")
            .expect("a delta")
            .event
        {
            Some(v1::generate_response::Event::Delta(d)) => d.token_ids.len(),
            _ => 0,
        };
        (stream, routed, first)
    });
    let at_victim = decodes
        .iter()
        .position(|(_, addr, _)| *addr == victim_addr)
        .expect("the long call's decode worker is one of ours");
    let (victim, _, _) = decodes.remove(at_victim);
    signal("-KILL", victim.0.id());
    drop(victim);
    let long_call = rt.spawn(async move {
        let mut stream = long_stream;
        let mut tokens = first_tokens;
        while let Some(msg) = stream.message().await? {
            if let Some(v1::generate_response::Event::Delta(d)) = msg.event {
                tokens += d.token_ids.len();
            }
        }
        Ok::<usize, tonic::Status>(tokens)
    });
    at(18);
    let etcd_pid = etcd.pid().expect("etcd runs");
    signal("-STOP", etcd_pid);
    at(24);
    signal("-CONT", etcd_pid);
    at(28);
    // The first router's count, before it goes.
    let migrated = tandem_tests::prometheus::scrape(&router_metrics)
        .value("tandem_router_migrations_total", &[("result", "resumed")])
        .unwrap_or(0.0);
    if let Some(r) = router.take() {
        signal("-KILL", r.0.id());
        drop(r);
    }
    std::thread::sleep(Duration::from_millis(500));
    let (r, _) = start_router();
    router = Some(r);
    at(31);
    // The last prefill worker and a decode worker freeze together.
    let frozen = [prefills[0].0 .0.id(), decodes[0].0 .0.id()];
    for pid in frozen {
        signal("-STOP", pid);
    }
    at(37);
    for pid in frozen {
        signal("-CONT", pid);
    }

    rt.block_on(load_task).expect("the load ran");
    let long_tokens = rt
        .block_on(long_call)
        .expect("the long call ran")
        .expect("the long call survived its decode worker");
    let outcomes = outcomes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let total: u64 = outcomes.values().sum();
    let ok = outcomes.get("ok").copied().unwrap_or(0);

    // Drained: every surviving worker holds nothing.
    let mut leaked = 0u64;
    rt.block_on(async {
        for (_, addr, _) in prefills.iter().chain(&decodes) {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let l = load(addr).await;
                if l.free_blocks == l.num_blocks && l.running + l.waiting + l.parked == 0 {
                    break;
                }
                if Instant::now() > deadline {
                    leaked += u64::from(l.num_blocks - l.free_blocks);
                    eprintln!("chaos: {addr} still holds blocks: {l:?}");
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let gauge = |metrics: &String, name: &str, labels: &[(&str, &str)]| {
        tandem_tests::prometheus::scrape(metrics)
            .value(name, labels)
            .unwrap_or(f64::NAN)
    };
    let open_tickets: f64 = decodes
        .iter()
        .map(|(_, _, m)| gauge(m, "tandem_kv_transfer_open_tickets", &[]))
        .sum();
    // Transfers open on either side of the surviving KV connections (a
    // sender learns of a killed receiver when its connection ends: polled).
    let open_transfers = || -> f64 {
        decodes
            .iter()
            .map(|(_, _, m)| {
                gauge(
                    m,
                    "tandem_kv_transfer_open_transfers",
                    &[("side", "receive")],
                )
            })
            .chain(prefills.iter().map(|(_, _, m)| {
                gauge(m, "tandem_kv_transfer_open_transfers", &[("side", "send")])
            }))
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let open_transfers = loop {
        let open = open_transfers();
        if open == 0.0 || Instant::now() > deadline {
            break open;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "chaos: {total} requests in {LOAD_SECONDS}s: {outcomes:?}; {migrated} migrated \
         to another decode worker; {leaked} KV blocks leaked on the surviving workers; \
         {open_tickets} transfer tickets and {open_transfers} transfers open"
    );
    assert_eq!(total, RATE * LOAD_SECONDS, "every request ended");
    assert_eq!(
        long_tokens, LONG_TOKENS as usize,
        "the migrated call's tokens"
    );
    assert!(migrated >= 1.0, "the long call migrated");
    assert_eq!(outcomes.get("hung"), None, "hung requests: {outcomes:?}");
    assert_eq!(leaked, 0, "leaked KV blocks");
    assert_eq!(
        open_tickets, 0.0,
        "open transfer tickets on the decode workers"
    );
    assert_eq!(
        open_transfers, 0.0,
        "open transfers on the surviving workers"
    );
    assert!(
        ok * 10 >= total * 7,
        "only {ok} of {total} requests completed: {outcomes:?}"
    );
    drop(router);
}
