//! Benchmarks for tandem. Binaries live in `src/bin/`; each writes JSON.
//!
//! Numbers are compared as ratios within one run (achieved against a roofline
//! measured on the same machine in the same process), never as absolute times
//! across runs: the machines are shared and noisy.

pub mod old_kv_index;

/// One step of xorshift64 on `state` (never 0): the benchmarks' seeded,
/// dependency-free random streams.
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

use std::time::Instant;

use rayon::prelude::*;
use tandem_engine::lora::LoraAdapter;
use tandem_engine::{BlockAllocator, BlockTable, KvCache, Model, SeqInput};

/// Decode throughput (tokens/s, the median step after one warm-up) of
/// `batch` sequences with `context` tokens cached each, over `steps` steps;
/// row `i` runs under `adapters[i % len]` (none when empty).
pub fn decode_tok_s(
    model: &Model,
    adapters: &[LoraAdapter],
    batch: usize,
    context: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let bs = 16;
    let vocab = model.config().vocab_size;
    let lora = |s: usize| (!adapters.is_empty()).then(|| &adapters[s % adapters.len()]);
    let per_seq = (context + steps + 2).div_ceil(bs);
    let pool = BlockAllocator::new(per_seq * batch, bs)?;
    let mut kv = KvCache::new(model.kv_layout(bs), per_seq * batch);
    let mut tables: Vec<BlockTable> = (0..batch).map(|_| BlockTable::new(&pool)).collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|s| {
            let token = |i: usize| ((s * 131 + i * 17) % vocab) as u32;
            (0..context).map(token).collect()
        })
        .collect();
    for t in &mut tables {
        t.append(context)?;
    }
    let inputs: Vec<SeqInput> = (0..batch)
        .map(|s| SeqInput {
            tokens: &prompts[s],
            start_pos: 0,
            blocks: tables[s].blocks(),
            all_logits: false,
            lora: lora(s),
        })
        .collect();
    model.forward(&inputs, &mut kv)?;
    let next: Vec<[u32; 1]> = (0..batch).map(|s| [((s * 7 + 3) % vocab) as u32]).collect();
    let mut secs = Vec::new();
    for step in 0..=steps {
        for t in &mut tables {
            t.append(1)?;
        }
        let inputs: Vec<SeqInput> = (0..batch)
            .map(|s| SeqInput {
                tokens: &next[s],
                start_pos: context + step,
                blocks: tables[s].blocks(),
                all_logits: false,
                lora: lora(s),
            })
            .collect();
        let t0 = Instant::now();
        model.forward(&inputs, &mut kv)?;
        secs.push(t0.elapsed().as_secs_f64());
    }
    // The first step warms up.
    Ok(batch as f64 / median(&secs[1..]))
}

/// Measured read bandwidth in bytes/s: every thread streams its share of a
/// buffer far larger than the caches, best of `reps` passes.
///
/// The reduction keeps 16 independent lanes so it vectorises; a plain scalar
/// float sum is latency-bound and reports a third of the real figure.
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let n = bytes / 4;
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut best = 0.0f64;
    let mut sink = 0.0f32;
    for _ in 0..reps {
        let t = Instant::now();
        let total: f32 = buf.par_chunks(1 << 20).map(sum_stream).sum();
        let secs = t.elapsed().as_secs_f64();
        sink += total;
        best = best.max((n * 4) as f64 / secs);
    }
    std::hint::black_box(sink);
    best
}

/// The sum of `chunk`, read at the widest loads the CPU has: the decode
/// kernels stream weights with 64-byte AVX-512 loads, and a 16-byte SSE
/// stream measured a quarter less from L3 than they reach.
fn sum_stream(chunk: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above).
        return unsafe { sum_avx512(chunk) };
    }
    let mut acc = [0.0f32; 16];
    for c in chunk.chunks_exact(16) {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_avx512(chunk: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    // Eight independent accumulators: the adds never wait on each other.
    let mut acc = [_mm512_setzero_ps(); 8];
    for (n, c) in chunk.chunks_exact(128).enumerate() {
        // Prefetch 2 KiB ahead, as the decode kernels do.
        if let Some(ahead) = chunk.get((n + 4) * 128..(n + 4) * 128 + 128) {
            for line in (0..128).step_by(16) {
                _mm_prefetch::<_MM_HINT_T0>(ahead[line..].as_ptr().cast());
            }
        }
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: c holds 128 floats, so 16 from 16·i are in bounds.
            *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * i)) });
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// Percentile (0–100) of an unsorted sample, nearest-rank.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Median of an unsorted sample (the mean of the middle two for an even
/// count); NaN for none.
pub fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => s[n / 2],
        _ => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty_samples() {
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn percentile_nearest_rank() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert_eq!(percentile(&v, 1.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn bandwidth_is_positive_and_finite() {
        let bw = read_bandwidth(8 << 20, 2);
        assert!(bw.is_finite() && bw > 1e8, "{bw}");
    }
}

/// The checkpoint a benchmark runs on: the one given, or a generated preset
/// (bf16, seed 0) in a temporary directory removed when this is dropped.
#[derive(Debug)]
pub struct BenchModel {
    pub dir: std::path::PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl BenchModel {
    /// `given`, else the synthetic `preset` written to a fresh temp dir.
    pub fn given_or_generated(
        given: Option<&std::path::Path>,
        preset: &str,
    ) -> anyhow::Result<Self> {
        if let Some(d) = given {
            return Ok(Self {
                dir: d.to_path_buf(),
                _tmp: None,
            });
        }
        let tmp = tempfile::tempdir()?;
        eprintln!("generating {preset} (bf16) in {}", tmp.path().display());
        tandem_engine::synth::preset(preset)?.write(tmp.path(), 0, tandem_engine::DType::Bf16)?;
        Ok(Self {
            dir: tmp.path().to_path_buf(),
            _tmp: Some(tmp),
        })
    }
}

/// Engine-measured TTFT (the `Finished` message's timings) of one greedy
/// 1-token request through the gRPC server at `addr`.
pub async fn engine_ttft(addr: &str, prompt: Vec<u32>) -> anyhow::Result<f64> {
    use tandem_proto::v1;
    let mut c = v1::generation_client::GenerationClient::connect(format!("http://{addr}")).await?;
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
            ids: prompt,
        })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        max_tokens: Some(1),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = c.generate(req).await?.into_inner();
    while let Some(msg) = s.message().await? {
        if let Some(v1::generate_response::Event::Finished(f)) = msg.event {
            return Ok(f.timings.map_or(0.0, |t| t.ttft_s));
        }
    }
    anyhow::bail!("no Finished message")
}

/// A running `tandem up` started by a benchmark: SIGTERM on drop stops it
/// and its children (it drains them and stops its etcd).
#[derive(Debug)]
pub struct TandemUp {
    child: std::process::Child,
    /// The router's gRPC address (`listening on ADDR`).
    pub addr: String,
}

impl TandemUp {
    /// Runs `tandem up ARGS` (stdout read up to `listening on`, then
    /// drained; stderr to `stderr`).
    pub fn start(
        tandem: &std::path::Path,
        args: &[String],
        stderr: std::process::Stdio,
    ) -> anyhow::Result<Self> {
        use std::io::BufRead;
        let mut child = std::process::Command::new(tandem)
            .arg("up")
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", tandem.display()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut up = Self {
            child,
            addr: String::new(),
        };
        let mut lines = std::io::BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            if let Some(a) = line?.strip_prefix("listening on ") {
                up.addr = a.to_string();
                std::thread::spawn(move || for _ in lines {});
                return Ok(up);
            }
        }
        anyhow::bail!("tandem up exited before listening")
    }
}

impl Drop for TandemUp {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}
