//! A DeepSeek-V3-shaped model (multi-head latent attention, `tiny-mla`)
//! through `tandem up` with real processes: a 700-token prompt prefilled on
//! the prefill worker and moved to the decode worker over TCP and over UCX
//! gives the tokens of a local prefill, and what moved is the latent
//! layout's bytes: one 40-float row per token and layer, no V.

use std::path::Path;

use tandem_tests::cluster::{all_blocks_free, greedy, Started};
use tandem_tests::prometheus::scrape;

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

/// The latent row of `tiny-mla`: kv_lora_rank 32 + qk_rope_head_dim 8.
const LATENT: usize = 40;
const LAYERS: usize = 2;
const BLOCK: usize = 16;

fn up(model: &Path, transport: &str, remote_from: &str, env: &[(&str, &str)]) -> Started {
    up_split(model, transport, remote_from, env, &[])
}

/// [`up`] with extra arguments (each pool's `--tp` / `--pp`).
fn up_split(
    model: &Path,
    transport: &str,
    remote_from: &str,
    env: &[(&str, &str)],
    extra: &[&str],
) -> Started {
    let mut args = vec![
        "up",
        "--model",
        model.to_str().expect("utf8"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--addr",
        "127.0.0.1:0",
        "--no-http",
        "--no-etcd",
        "--kv-cache-memory",
        "32MiB",
        "--remote-prefill-threshold",
        remote_from,
        "--kv-transport",
        transport,
        "--worker-arg=--batch-invariant",
    ];
    args.extend_from_slice(extra);
    tandem_tests::cluster::start_with_env(tandem(), &args, env)
}

fn prompt() -> Vec<u32> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..700)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as u32
        })
        .collect()
}

/// Greedy tokens for the prompt, and whether a prefill worker ran it.
fn generate(cluster: &Started) -> (Vec<u32>, bool) {
    let rt = tandem_tests::cluster::runtime();
    rt.block_on(async {
        let out = greedy(&cluster.addr, prompt(), 12).await.expect("generate");
        all_blocks_free(cluster).await;
        (out.tokens, out.prefill.is_some())
    })
}

/// (block-layers, bytes) the decode worker received.
fn received(cluster: &Started) -> (f64, f64) {
    let m = cluster
        .metrics_addr("decode-worker", &cluster.decode[0])
        .expect("decode metrics");
    let s = scrape(m);
    (
        s.sum("tandem_kv_transfer_received_block_layers_total", &[]),
        s.sum("tandem_kv_transfer_received_bytes_total", &[]),
    )
}

#[test]
fn remote_prefill_of_a_latent_model_matches_local_and_moves_latent_rows() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-mla");
    let (local, remote) = generate(&up(tmp.path(), "tcp", "100000", &[]));
    assert!(!remote, "the reference prefills on the decode worker");
    assert_eq!(local.len(), 12);
    let ucx_tcp: &[(&str, &str)] = &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];
    for (transport, env) in [("tcp", &[][..]), ("ucx", ucx_tcp)] {
        let cluster = up(tmp.path(), transport, "16", env);
        let (tokens, remote) = generate(&cluster);
        assert!(remote, "{transport}: prefilled remotely");
        assert_eq!(
            tokens, local,
            "{transport}: tokens differ from local prefill"
        );
        let (block_layers, bytes) = received(&cluster);
        // Every full block of the prompt, every layer: one f32 latent row
        // per token, nothing for V.
        let full_blocks = (700 / BLOCK) as f64;
        assert!(
            block_layers >= full_blocks * LAYERS as f64,
            "{transport}: {block_layers} block-layers"
        );
        assert_eq!(
            bytes,
            block_layers * (BLOCK * LATENT * 4) as f64,
            "{transport}: bytes per block-layer are the latent layout's"
        );
        eprintln!("{transport}: {block_layers} block-layers, {bytes} bytes for 700 tokens");
    }
}

/// `tandem plan` counts a latent cache's bytes: `layers × (kv_lora_rank +
/// qk_rope_head_dim) × dtype bytes` per token, and 8-bit scales per latent
/// row (one per token and layer, not two per KV head).
#[test]
fn tandem_plan_counts_one_latent_row_per_token_and_layer() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-mla");
    for (dtype, bytes) in [("f32", 4), ("bf16", 2), ("int8", 1)] {
        let out = std::process::Command::new(tandem())
            .args(["plan", "--model"])
            .arg(tmp.path())
            .args(["--json", "--memory", "64MiB", "--kv-dtype", dtype])
            .output()
            .expect("tandem plan runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let p: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let per_token = (LAYERS * LATENT * bytes) as u64;
        assert_eq!(p["kv_bytes_per_token"], per_token, "{dtype}");
        let scales = if bytes == 1 { LAYERS * BLOCK * 2 } else { 0 };
        assert_eq!(
            p["bytes_per_block"],
            BLOCK as u64 * per_token + scales as u64,
            "{dtype}"
        );
    }
}

/// Pools split differently on either side of the seam: the latent is one
/// "KV head", replicated on every tensor-parallel rank, so a block crosses
/// whole whatever the split; the tokens are a local prefill's.
#[test]
fn latent_blocks_cross_between_pools_with_different_splits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    tandem_tests::cluster::gen_model(tandem(), tmp.path(), "tiny-mla");
    let (local, _) = generate(&up(tmp.path(), "tcp", "100000", &[]));
    for split in [
        ["--prefill-arg=--tp=2", "--decode-arg=--tp=1"],
        ["--prefill-arg=--tp=1", "--decode-arg=--tp=2"],
        ["--prefill-arg=--pp=2", "--decode-arg=--tp=2"],
    ] {
        let cluster = up_split(tmp.path(), "tcp", "16", &[], &split);
        let (tokens, remote) = generate(&cluster);
        assert!(remote, "{split:?}: prefilled remotely");
        assert_eq!(tokens, local, "{split:?}");
    }
}
