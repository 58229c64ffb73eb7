//! CPU kernels.
//!
//! All activations are f32; weights are read in their stored dtype and
//! widened in registers. [`linear`] picks between two strategies by the number
//! of token rows `m`:
//!
//! * `m <= GEMV_MAX_ROWS` (decode, small batches): a weight-stationary kernel
//!   that streams each weight row once from memory and dots it with every
//!   token row while it sits in L1. Decode is memory-bound, so reading the
//!   weights once per step, in bf16 when the checkpoint is bf16, is the point.
//! * larger `m` (prefill): the `gemm` crate's tuned f32 GEMM, with bf16/f16
//!   weights widened into a scratch matrix first (O(n·k) work against the
//!   GEMM's O(m·n·k)).
//! * bf16 weights from [`AMX_MIN_ROWS`] rows, where the CPU has AMX tiles
//!   ([`amx`], [`MatmulPolicy::Fastest`]): the weights as they lie against
//!   activations packed in two bf16 halves per call. Measured with
//!   `engine-bench` on SmolLM2-135M: prefill 2.2x and batch-32 decode 1.6x
//!   the vector kernels; below 12 rows the row kernel is as fast (both
//!   stream the weights).
//! * bf16 weights under [`MatmulPolicy::Bf16Activations`], where the CPU
//!   has AVX512-BF16 ([`dpbf16`]): activations rounded to bf16 meet the
//!   weights on `vdpbf16ps`, twice the vector kernels' arithmetic rate, at
//!   every batch size; with AVX2 alone, the same chains on FMAs
//!   ([`dpbf16::fma`]). A model's linear layers are packed for it into
//!   panels ([`Panels`], [`linear_panels`]) when the policy is set.
//!
//! INT4 weights have their own kernels ([`int4`]): integer dot products
//! against activations quantized to int8 per group. So do GGUF-quantized
//! weights kept in their file's blocks ([`ggml`]).
//!
//! Work is split over rayon's persistent pool: thread start-up would dominate
//! the small matrices of small models.

mod activation;
#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
pub mod dpbf16;
pub mod ggml;
pub mod int4;
mod int4_simd;
mod panels;
mod policy;
pub mod rope;
pub(crate) mod simd;
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd512;

pub use activation::{clamped_swiglu_mul, gelu_tanh_mul, silu_mul, softcap_in_place};
pub use ggml::{linear_ggml, GgmlMatrix};
pub use int4::{linear_int4, linear_residual_int4};
pub use panels::{linear_panels, PanelLinear, Panels};
pub use policy::{MatmulPolicy, AMX_MIN_ROWS};
pub use rope::RopeTable;

use rayon::prelude::*;

use crate::weights::{Matrix, WeightData};

/// Above this many token rows, [`linear`] uses the GEMM path.
pub const GEMV_MAX_ROWS: usize = 48;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`.
pub fn linear(
    x: &[f32],
    m: usize,
    w: &Matrix,
    bias: Option<&[f32]>,
    policy: MatmulPolicy,
    out: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(out.len(), m * n);
    #[cfg(target_arch = "x86_64")]
    if policy.rounds_for_rows(w) {
        let x = dpbf16::fma::rounded(x);
        return linear(&x, m, w, bias, MatmulPolicy::BatchInvariant, out);
    }
    if uses_dpbf16(w, policy) {
        linear_dpbf16(x, m, &mut [FusedLinear { w, bias: None, out }]);
    } else if uses_amx(m, w, policy) {
        linear_amx(x, m, &mut [FusedLinear { w, bias: None, out }]);
    } else if policy.uses_row_kernel(m) {
        linear_rows(x, m, w, out);
    } else {
        linear_gemm(x, m, w, out);
    }
    if let Some(b) = bias {
        add_bias(out, n, b);
    }
}

/// Adds `bias` to each of `out`'s rows of `n`.
pub(crate) fn add_bias(out: &mut [f32], n: usize, bias: &[f32]) {
    for row in out.chunks_exact_mut(n) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

/// Raw output pointer shared by parallel tasks that write disjoint elements
/// of one buffer (columns here, (row, head) slices in attention).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: used only to let rayon tasks write disjoint parts of one buffer;
// every user gives each task a range no other task touches.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Splits the `n` output rows of a linear over `m` tokens into ranges
/// over rayon's pool (several per thread for balance, multiples of the
/// 4-row micro tile) and runs `rows(r0, r1, out)` on each: the row kernels
/// of every weight format share it. `out` is the whole m×n result (row
/// stride `n`); a task must write only columns `r0..r1` of it.
pub(crate) fn par_row_ranges(
    n: usize,
    m: usize,
    out: &mut [f32],
    rows: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    par_row_ranges_by(n, m, out, 4, rows);
}

/// [`par_row_ranges`] with every range starting at a multiple of `align`:
/// [`par_outputs`] with one output.
pub(crate) fn par_row_ranges_by(
    n: usize,
    m: usize,
    out: &mut [f32],
    align: usize,
    rows: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    par_outputs(m, vec![((), n, out)], align, |(), r0, r1, out| {
        rows(r0, r1, out)
    });
}

fn linear_rows(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    par_row_ranges(w.rows, m, out, |r0, r1, out| {
        dense_rows(w, r0, r1, x, m, out)
    });
}

/// Rows `r0..r1` of `x · wᵀ` into `out` (m × `w.rows`), on this thread.
fn dense_rows(w: &Matrix, r0: usize, r1: usize, x: &[f32], m: usize, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    match &w.data {
        WeightData::F32(d) => simd::rows_f32(&d[r0 * k..r1 * k], k, x, m, out, n, r0),
        WeightData::Bf16(d) => simd::rows_bf16(&d[r0 * k..r1 * k], k, x, m, out, n, r0),
        WeightData::F16(d) => simd::rows_f16(&d[r0 * k..r1 * k], k, x, m, out, n, r0),
    }
}

/// One linear of [`linear_fused`]: its weights, bias and output
/// (`m × w.rows`).
#[derive(Debug)]
pub struct FusedLinear<'a> {
    pub w: &'a Matrix,
    pub bias: Option<&'a [f32]>,
    pub out: &'a mut [f32],
}

/// Several linears of one input (q/k/v, gate/up) in one parallel region
/// when the row kernel runs them: one hand-off to the pool instead of one
/// each. A small model's decode step is hundreds of such regions over
/// matrices that stream in tens of microseconds, so the hand-offs are a
/// large share of it. Every output is what [`linear`] gives, bit for bit
/// (the same kernel over the same rows; a row's result does not depend on
/// the range it was computed in). The GEMM path runs them one by one.
pub fn linear_fused(x: &[f32], m: usize, parts: &mut [FusedLinear<'_>], policy: MatmulPolicy) {
    #[cfg(target_arch = "x86_64")]
    if parts.iter().all(|p| policy.rounds_for_rows(p.w)) {
        let x = dpbf16::fma::rounded(x);
        return linear_fused(&x, m, parts, MatmulPolicy::BatchInvariant);
    }
    if parts.iter().all(|p| uses_dpbf16(p.w, policy)) {
        linear_dpbf16(x, m, parts);
        add_biases(m, parts);
        return;
    }
    if parts.iter().all(|p| uses_amx(m, p.w, policy)) {
        linear_amx(x, m, parts);
        add_biases(m, parts);
        return;
    }
    if !policy.uses_row_kernel(m) {
        for p in parts.iter_mut() {
            linear(x, m, p.w, p.bias, policy, p.out);
        }
        return;
    }
    par_fused_rows(m, parts, 4, |w, r0, r1, out| {
        dense_rows(w, r0, r1, x, m, out)
    });
    add_biases(m, parts);
}

/// Splits the rows of every part into ranges (starting at multiples of
/// `align`, several per thread) and runs `rows(w, r0, r1, out)` on each
/// over rayon's pool, `out` being that part's whole `m × w.rows` output; a
/// task must write only columns `r0..r1` of it.
fn par_fused_rows(
    m: usize,
    parts: &mut [FusedLinear<'_>],
    align: usize,
    rows: impl Fn(&Matrix, usize, usize, &mut [f32]) + Sync,
) {
    let outputs = parts
        .iter_mut()
        .map(|p| (p.w, p.w.rows, &mut *p.out))
        .collect();
    par_outputs(m, outputs, align, rows);
}

/// Splits the `n` rows of every `(w, n, out)` over rayon's pool and runs
/// `rows(w, r0, r1, out)` on each piece: one hand-off for all of them.
/// The outputs' rows, taken end to end in units of `align` (a range starts
/// at a multiple of it), are cut into tasks of equal size (± one unit),
/// several per thread; a task may finish one output and start the next.
/// Equal tasks keep the threads level: rayon halves a task list by count,
/// and unequal pieces (a matrix of 36 units in chunks of 5) had left one
/// thread a fifth more than the other. `out` is that part's whole `m × n`
/// output; a call must write only its columns `r0..r1`.
pub(crate) fn par_outputs<W: Copy + Sync>(
    m: usize,
    outputs: Vec<(W, usize, &mut [f32])>,
    align: usize,
    rows: impl Fn(W, usize, usize, &mut [f32]) + Sync,
) {
    for (_, n, out) in &outputs {
        assert!(out.len() >= m * n, "each output holds m × n values");
    }
    let align = align.max(1);
    let targets: Vec<(W, usize, OutPtr)> = outputs
        .into_iter()
        .map(|(w, n, out)| (w, n, OutPtr(out.as_mut_ptr())))
        .collect();
    // Unit u of output i covers its rows align·u .. align·(u + 1) (the last
    // one clipped); `first[i]` is output i's first unit end to end.
    let mut first = Vec::with_capacity(targets.len() + 1);
    let mut units = 0;
    for &(_, n, _) in &targets {
        first.push(units);
        units += n.div_ceil(align);
    }
    first.push(units);
    let threads = rayon::current_num_threads().max(1);
    let tasks = units.min(threads * 4);
    (0..tasks).into_par_iter().for_each(|task| {
        let (u0, u1) = (task * units / tasks, (task + 1) * units / tasks);
        for (i, &(w, n, ptr)) in targets.iter().enumerate() {
            let (a, b) = (u0.max(first[i]), u1.min(first[i + 1]));
            if a >= b {
                continue;
            }
            let (r0, r1) = ((a - first[i]) * align, ((b - first[i]) * align).min(n));
            // SAFETY: the tasks' unit ranges partition every output's rows,
            // so this call writes columns r0..r1 of output i and no other
            // task does; the output holds m × n values (asserted above)
            // and outlives the parallel loop.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr.0, m * n) };
            rows(w, r0, r1, out);
        }
    });
}

/// Whether `w` runs on [`dpbf16`] under `policy`.
fn uses_dpbf16(w: &Matrix, policy: MatmulPolicy) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        policy == MatmulPolicy::Bf16Activations
            && matches!(w.data, WeightData::Bf16(_))
            && dpbf16::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, policy);
        false
    }
}

/// `parts` (each bf16, one input) on [`dpbf16`]: the activations rounded
/// once, the rows of every part split over the pool in groups of 16 (one
/// reduction and one store each). Biases are not added.
#[cfg(target_arch = "x86_64")]
fn linear_dpbf16(x: &[f32], m: usize, parts: &mut [FusedLinear<'_>]) {
    let k = parts.first().map_or(0, |p| p.w.cols);
    assert!(
        parts.iter().all(|p| p.w.cols == k),
        "fused linears share their input"
    );
    let tokens = dpbf16::Bf16Tokens::new(x, m, k);
    par_fused_rows(m, parts, 16, |w, r0, r1, out| match &w.data {
        // SAFETY: `uses_dpbf16` checked the CPU; rows r0..r1 are whole rows
        // of w, `out` holds m × w.rows (par_fused_rows checks it).
        WeightData::Bf16(d) => unsafe {
            dpbf16::rows(&d[r0 * k..r1 * k], &tokens, out, w.rows, r0)
        },
        // `uses_dpbf16` admits bf16 only; anything else keeps its kernel.
        _ => dense_rows(w, r0, r1, x, m, out),
    });
}

#[cfg(not(target_arch = "x86_64"))]
fn linear_dpbf16(x: &[f32], m: usize, parts: &mut [FusedLinear<'_>]) {
    for p in parts.iter_mut() {
        linear_rows(x, m, p.w, p.out);
    }
}

fn add_biases(m: usize, parts: &mut [FusedLinear<'_>]) {
    for p in parts.iter_mut() {
        if let Some(b) = p.bias {
            add_bias(&mut p.out[..m * p.w.rows], p.w.rows, b);
        }
    }
}

/// Whether `m` rows through `w` run on AMX tiles ([`amx`]).
fn uses_amx(m: usize, w: &Matrix, policy: MatmulPolicy) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        policy == MatmulPolicy::Fastest
            && m >= AMX_MIN_ROWS
            && matches!(w.data, WeightData::Bf16(_))
            && amx::fits(w.cols)
            && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, w, policy);
        false
    }
}

/// `parts` (each bf16 and fitting [`amx::fits`]) on AMX tiles in one
/// parallel region over their rows: the activations are packed once, each
/// weight's tiled rows are split into ranges of multiples of 32, and rows
/// past the last full tile take the row kernel. Biases are not added.
#[cfg(target_arch = "x86_64")]
fn linear_amx(x: &[f32], m: usize, parts: &mut [FusedLinear<'_>]) {
    let k = parts.first().map_or(0, |p| p.w.cols);
    let packed = amx::PackedTokens::new(x, m, k);
    let total: usize = parts.iter().map(|p| p.w.rows).sum();
    let threads = rayon::current_num_threads().max(1);
    let chunk = total.div_ceil(threads * 4).next_multiple_of(32).max(32);
    // (part, first row, end row, on tiles)
    let mut tasks: Vec<(usize, usize, usize, bool)> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        assert!(
            p.out.len() >= m * p.w.rows,
            "each output holds m × n values"
        );
        assert_eq!(p.w.cols, k, "fused linears share their input");
        let tiled = amx::tiled_rows(p.w.rows);
        tasks.extend(
            (0..tiled)
                .step_by(chunk)
                .map(|r0| (i, r0, (r0 + chunk).min(tiled), true)),
        );
        if tiled < p.w.rows {
            tasks.push((i, tiled, p.w.rows, false));
        }
    }
    let targets: Vec<(&Matrix, OutPtr)> = parts
        .iter_mut()
        .map(|p| (p.w, OutPtr(p.out.as_mut_ptr())))
        .collect();
    tasks.into_par_iter().for_each(|(i, r0, r1, tiles)| {
        let (w, ptr) = targets[i];
        // SAFETY: the task writes columns r0..r1 of output i only (the
        // tasks partition each output's columns); the output holds m × n
        // values (checked above) and outlives the parallel loop.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr.0, m * w.rows) };
        match &w.data {
            WeightData::Bf16(d) if tiles => amx::rows(d, w.rows, &packed, r0, r1, out),
            _ => dense_rows(w, r0, r1, x, m, out),
        }
    });
}

#[cfg(not(target_arch = "x86_64"))]
fn linear_amx(x: &[f32], m: usize, parts: &mut [FusedLinear<'_>]) {
    for p in parts.iter_mut() {
        linear_rows(x, m, p.w, p.out);
    }
}

pub(crate) fn linear_gemm(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let widened;
    let wf: &[f32] = match &w.data {
        WeightData::F32(d) => d,
        _ => {
            let mut buf = vec![0.0f32; n * k];
            buf.par_chunks_mut(k)
                .enumerate()
                .for_each(|(r, row)| w.row_to_f32(r, row));
            widened = buf;
            &widened
        }
    };
    let threads = rayon::current_num_threads();
    // SAFETY: dst is m×n row-major (row stride n, column stride 1), lhs is
    // x as m×k row-major, rhs is wᵀ as k×n read from w's n×k rows (row
    // stride 1, column stride k); all three buffers have exactly those sizes
    // and dst does not alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            wf.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}

/// Hugging Face `RMSNorm`: `x / sqrt(mean(x²) + eps) * weight`, row by row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = rms_inv(xr, eps);
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// [`rms_norm`] in place, over rows of `weight.len()` (a whole hidden
/// vector, or one head for per-head q/k norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for xr in x.chunks_exact_mut(d) {
        let inv = rms_inv(xr, eps);
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

fn rms_inv(row: &[f32], eps: f32) -> f32 {
    let ss = simd::dot_f32(row, row);
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

/// `x *= s`, in place.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// `acc += x`.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

pub use simd::{axpy_f32, dot_f32};

/// `log_softmax` of one row, in place; returns nothing, the row is replaced.
pub fn log_softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| f64::from((v - max).exp())).sum();
    let lse = max + sum.ln() as f32;
    for v in row.iter_mut() {
        *v -= lse;
    }
}

/// Deterministic values in [−1, 1] for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Every column of every output is written once, by a call for its own
    /// output, in ranges that start on the alignment, whatever the sizes.
    #[test]
    fn par_outputs_covers_each_output_once_in_aligned_ranges() {
        for (sizes, align) in [
            (vec![576, 192, 192], 16),
            (vec![36 * 16], 16),
            (vec![5, 3, 1], 4),
            (vec![1], 16),
            (vec![0, 40, 0, 7], 8),
        ] {
            let m = 3;
            let mut outs: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; m * n]).collect();
            let outputs = outs
                .iter_mut()
                .enumerate()
                .map(|(i, o)| (i, sizes[i], o.as_mut_slice()))
                .collect();
            par_outputs(m, outputs, align, |i, r0, r1, out| {
                assert_eq!(r0 % align, 0, "{sizes:?}: a range starts on the alignment");
                assert!(
                    r0 < r1 && r1 <= sizes[i],
                    "{sizes:?}: {r0}..{r1} of {}",
                    sizes[i]
                );
                for t in 0..m {
                    for v in &mut out[t * sizes[i] + r0..t * sizes[i] + r1] {
                        *v += (i + 1) as f32;
                    }
                }
            });
            for (i, o) in outs.iter().enumerate() {
                assert!(
                    o.iter().all(|&v| v == (i + 1) as f32),
                    "{sizes:?}: output {i}"
                );
            }
        }
    }

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for t in 0..m {
            for r in 0..n {
                out[t * n + r] = (0..k).map(|i| x[t * k + i] * w[r * k + i]).sum();
            }
        }
        out
    }

    use super::test_values as pseudo;

    #[test]
    fn fused_linears_equal_separate_ones_bit_for_bit() {
        // 40: the row kernel and the GEMM; 64: AMX tiles where the CPU has
        // them (37 and 9 rows: tiles and row-kernel tails).
        for k in [40, 64] {
            fused_equals_separate(k);
        }
    }

    fn fused_equals_separate(k: usize) {
        let bf16_matrix = |n: usize, seed: u32| Matrix {
            rows: n,
            cols: k,
            data: WeightData::Bf16(
                pseudo(n * k, seed)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect::<Vec<_>>()
                    .into(),
            ),
        };
        // q/k/v-like shapes: one wide, two narrow with a bias.
        let (wq, wk, wv) = (bf16_matrix(37, 3), bf16_matrix(9, 4), bf16_matrix(9, 5));
        let bias = pseudo(9, 6);
        for (m, policy) in [
            (1, MatmulPolicy::Fastest),
            (6, MatmulPolicy::Fastest),
            (48, MatmulPolicy::Fastest),
            (60, MatmulPolicy::Fastest),
            (60, MatmulPolicy::BatchInvariant),
            (1, MatmulPolicy::Bf16Activations),
            (60, MatmulPolicy::Bf16Activations),
        ] {
            let x = pseudo(m * k, 7);
            let mut want = [vec![0.0; m * 37], vec![0.0; m * 9], vec![0.0; m * 9]];
            linear(&x, m, &wq, None, policy, &mut want[0]);
            linear(&x, m, &wk, Some(&bias), policy, &mut want[1]);
            linear(&x, m, &wv, None, policy, &mut want[2]);
            let mut got = [vec![0.0; m * 37], vec![0.0; m * 9], vec![0.0; m * 9]];
            let [gq, gk, gv] = &mut got;
            let mut parts = [
                FusedLinear {
                    w: &wq,
                    bias: None,
                    out: gq,
                },
                FusedLinear {
                    w: &wk,
                    bias: Some(&bias),
                    out: gk,
                },
                FusedLinear {
                    w: &wv,
                    bias: None,
                    out: gv,
                },
            ];
            linear_fused(&x, m, &mut parts, policy);
            for (g, w) in got.iter().zip(&want) {
                let (g, w): (Vec<u32>, Vec<u32>) = (
                    g.iter().map(|v| v.to_bits()).collect(),
                    w.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(g, w, "k={k} m={m} {policy:?}");
            }
        }
    }

    /// bf16 activations: each token's outputs are the same bits alone and
    /// in a prefill-sized batch (past the GEMM's threshold), and within
    /// bf16 rounding of the f32-activation result.
    #[test]
    fn bf16_activations_are_batch_invariant_and_close_to_f32() {
        let (n, k, m) = (70, 96, 60);
        let w = Matrix {
            rows: n,
            cols: k,
            data: WeightData::Bf16(
                pseudo(n * k, 11)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect::<Vec<_>>()
                    .into(),
            ),
        };
        let x = pseudo(m * k, 12);
        let mut batch = vec![0.0; m * n];
        linear(&x, m, &w, None, MatmulPolicy::Bf16Activations, &mut batch);
        let mut exact = vec![0.0; m * n];
        linear(&x, m, &w, None, MatmulPolicy::BatchInvariant, &mut exact);
        for t in 0..m {
            let mut alone = vec![0.0; n];
            let row = &x[t * k..(t + 1) * k];
            linear(row, 1, &w, None, MatmulPolicy::Bf16Activations, &mut alone);
            assert_eq!(alone, batch[t * n..(t + 1) * n], "token {t}");
        }
        // |Σ w·(x − bf16(x))| ≤ 2⁻⁹ Σ |w·x|; the values are within ±1.
        let worst = batch
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let bound = k as f32 / 512.0;
        assert!(worst <= bound, "worst {worst} > {bound}");
        if MatmulPolicy::Bf16Activations.runs_here() {
            assert!(worst > 0.0, "the activations were not rounded");
        }
    }

    #[test]
    fn linear_matches_naive_for_all_dtypes_and_shapes() {
        for &(m, n, k) in &[
            (1, 7, 5),
            (3, 33, 19),
            (5, 64, 40),
            (60, 9, 17),
            (1, 130, 264),
        ] {
            let x = pseudo(m * k, 1);
            let wv = pseudo(n * k, 2);
            let want = naive(&x, m, &wv, n, k);
            let mats = [
                WeightData::F32(wv.clone().into()),
                WeightData::Bf16(
                    wv.iter()
                        .map(|&v| bf16::from_f32(v))
                        .collect::<Vec<_>>()
                        .into(),
                ),
                WeightData::F16(
                    wv.iter()
                        .map(|&v| f16::from_f32(v))
                        .collect::<Vec<_>>()
                        .into(),
                ),
            ];
            for data in mats {
                let tol = if matches!(data, WeightData::F32(_)) {
                    1e-4
                } else {
                    3e-2
                };
                let w = Matrix {
                    rows: n,
                    cols: k,
                    data,
                };
                let mut out = vec![0.0; m * n];
                linear(&x, m, &w, None, MatmulPolicy::Fastest, &mut out);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < tol * (1.0 + b.abs()),
                        "{m}x{n}x{k} {:?}: {a} vs {b}",
                        w.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn log_softmax_normalises() {
        let mut r = vec![1.0, 2.0, 3.0];
        log_softmax(&mut r);
        let total: f32 = r.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
