//! bf16 weights packed at load into panels of 16 rows, for
//! [`MatmulPolicy::Bf16Activations`](super::MatmulPolicy) (`vdpbf16ps`).
//!
//! Read as stored (`[n][k]` row-major), a 64-byte load of weights is 32
//! columns of one row, so every output's accumulator holds 16 partial sums
//! that a transposing add tree must reduce at the end: at the widths of
//! small models (k = 576–768) that tree cost 13–18% of the row kernel
//! ([`super::dpbf16`]). Packed, a 64-byte load is **two columns of 16 rows**
//! (lane `r` holds row `16p + r`'s columns `2j, 2j + 1`), and one
//! `vdpbf16ps` against a token's pair of activations broadcast to every
//! lane adds both products into each of the 16 rows' own lane: an
//! accumulator is 16 finished outputs, stored as it is.
//!
//! **Layout.** Panel `p` (rows `16p..16p + 16`) is `ceil(k / 2)` pairs of
//! 64 bytes, one after another, so a panel streams from memory in order;
//! rows past `n` and the column past an odd `k` are zero. A model's packed
//! copies share one region on huge pages ([`Panels::pack_all`]; as
//! [`crate::weights::Residency::HugePages`] holds a file) and replace the
//! stored matrices: a model packs its linear layers and head once when the
//! policy is set, and unpacks them ([`Panels::to_matrix`]) if it changes.
//!
//! **Numerics.** An output is one chain of `vdpbf16ps` over the pairs in
//! column order, whatever tile or batch it ran in: batch invariant by
//! construction. The products are those of the row kernel (bf16 × bf16,
//! exact in f32); only the order of the f32 additions differs.

use std::sync::Arc;

use rayon::prelude::*;

use half::bf16;

use crate::weights::{Buf, HugePageBytes, Matrix, WeightData};

/// Output rows one panel holds: one per f32 lane of an accumulator.
pub(crate) const LANES: usize = 16;

/// A bf16 weight matrix packed into panels of 16 rows, in a region on
/// huge pages that it may share with the other matrices packed with it
/// ([`Panels::pack_all`]).
pub struct Panels {
    region: Arc<HugePageBytes>,
    /// Where this matrix's panels start in the region, in bytes.
    offset: usize,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Panels")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// bf16 elements of one panel of `cols` columns.
fn panel_len(cols: usize) -> usize {
    cols.div_ceil(2) * LANES * 2
}

/// Bytes of `w` packed, when it packs (bf16, not empty).
fn packed_size(w: &Matrix) -> Option<usize> {
    let packs = matches!(w.data, WeightData::Bf16(_)) && w.rows > 0 && w.cols > 0;
    packs.then(|| w.rows.div_ceil(LANES) * panel_len(w.cols) * 2)
}

impl Panels {
    /// `w` packed, when it is bf16 (other dtypes have no panel kernel).
    pub fn pack(w: &Matrix) -> Option<Self> {
        Self::pack_all(&[w]).pop().flatten()
    }

    /// Each of `ws` packed (`None` for one that is not bf16), all in one
    /// region: huge pages come in 2 MiB, and a small model's matrices are
    /// smaller than that (a region each held SmolLM2-135M's in 1.8x their
    /// bytes).
    pub fn pack_all(ws: &[&Matrix]) -> Vec<Option<Self>> {
        let sizes: Vec<Option<usize>> = ws.iter().map(|w| packed_size(w)).collect();
        let mut region = HugePageBytes::zeroed(sizes.iter().flatten().sum());
        let mut offsets = Vec::with_capacity(ws.len());
        let mut rest: &mut [u8] = &mut region;
        let mut offset = 0;
        for (w, size) in ws.iter().zip(&sizes) {
            offsets.push(offset);
            let (Some(size), WeightData::Bf16(data)) = (size, &w.data) else {
                continue;
            };
            let (this, tail) = std::mem::take(&mut rest).split_at_mut(*size);
            pack_into(data, w.rows, w.cols, bytemuck::cast_slice_mut(this));
            rest = tail;
            offset += size;
        }
        let region = Arc::new(region);
        ws.iter()
            .zip(&sizes)
            .zip(offsets)
            .map(|((w, size), offset)| {
                size.map(|_| Self {
                    region: Arc::clone(&region),
                    offset,
                    rows: w.rows,
                    cols: w.cols,
                })
            })
            .collect()
    }

    /// The row-major matrix this was packed from.
    pub fn to_matrix(&self) -> Matrix {
        let (rows, cols) = (self.rows, self.cols);
        let packed = self.packed();
        let panel_len = self.panel_len();
        let mut data = vec![bf16::ZERO; rows * cols];
        for (i, row) in data.chunks_exact_mut(cols.max(1)).enumerate() {
            let panel = &packed[(i / LANES) * panel_len..][..panel_len];
            for (c, v) in row.iter_mut().enumerate() {
                *v = panel[((c / 2) * LANES + i % LANES) * 2 + c % 2];
            }
        }
        Matrix {
            rows,
            cols,
            data: WeightData::Bf16(Buf::from(data)),
        }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the packed panels occupy (padding included).
    pub fn bytes(&self) -> usize {
        self.panels() * self.panel_len() * 2
    }

    /// Panels (`rows / 16`, rounded up).
    pub(crate) fn panels(&self) -> usize {
        self.rows.div_ceil(LANES)
    }

    /// Column pairs a panel holds.
    pub(crate) fn pairs(&self) -> usize {
        self.cols.div_ceil(2)
    }

    /// bf16 elements per panel.
    pub(crate) fn panel_len(&self) -> usize {
        panel_len(self.cols)
    }

    /// Every panel, one after another.
    pub(crate) fn packed(&self) -> &[bf16] {
        bytemuck::cast_slice(&self.region[self.offset..self.offset + self.bytes()])
    }
}

/// `data` (`rows × cols`, row-major) into `packed`, zeroed, in the panel
/// layout: panel `p`, pair `j`, lane `r`, half `e` at
/// `((p · pairs + j) · 16 + r) · 2 + e`.
fn pack_into(data: &[bf16], rows: usize, cols: usize, packed: &mut [bf16]) {
    packed
        .par_chunks_mut(panel_len(cols))
        .enumerate()
        .for_each(|(p, panel)| {
            for r in 0..LANES.min(rows - p * LANES) {
                let row = &data[(p * LANES + r) * cols..][..cols];
                for (c, &v) in row.iter().enumerate() {
                    panel[((c / 2) * LANES + r) * 2 + c % 2] = v;
                }
            }
        });
}

/// One linear of [`linear_panels`]: its packed weights, bias and output
/// (`m × w.rows()`).
#[derive(Debug)]
pub struct PanelLinear<'a> {
    pub w: &'a Panels,
    pub bias: Option<&'a [f32]>,
    pub out: &'a mut [f32],
}

/// `parts` (one input `x`, `m` token rows) in one parallel region: the
/// activations rounded to bf16 once, every part's panels split over the
/// pool in ranges of whole tiles. Biases are added.
pub fn linear_panels(x: &[f32], m: usize, parts: &mut [PanelLinear<'_>]) {
    let k = parts.first().map_or(0, |p| p.w.cols);
    assert!(
        parts.iter().all(|p| p.w.cols == k),
        "fused linears share their input"
    );
    run(&x[..m * k], m, k, parts);
    for p in parts.iter_mut() {
        if let Some(b) = p.bias {
            super::add_bias(&mut p.out[..m * p.w.rows], p.w.rows, b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn run(x: &[f32], m: usize, k: usize, parts: &mut [PanelLinear<'_>]) {
    use super::dpbf16::{self, fma, panels};
    if dpbf16::available() {
        let tokens = dpbf16::Bf16Tokens::new(x, m, k);
        // SAFETY: `available()` holds (checked above).
        unsafe { run_on::<panels::Dpbf16>(tokens.rows(), parts) }
    } else if fma::available() {
        let tokens = fma::F32Tokens::new(x, m, k);
        // SAFETY: `available()` holds (checked above).
        unsafe { run_on::<fma::Fma>(tokens.rows(), parts) }
    } else {
        reference(x, m, parts)
    }
}

/// `parts` on kernel `K`, their panels split over the pool.
///
/// # Safety
/// The CPU has `K`'s features; `x`'s rows are readable as
/// [`super::dpbf16::panels::TokenRows`] says and stay alive.
#[cfg(target_arch = "x86_64")]
unsafe fn run_on<K: super::dpbf16::panels::PanelKernel<X: Copy>>(
    x: super::dpbf16::panels::TokenRows<K::X>,
    parts: &mut [PanelLinear<'_>],
) {
    let outputs = parts
        .iter_mut()
        .map(|p| (p.w, p.w.rows, &mut *p.out))
        .collect();
    super::par_outputs(x.m, outputs, LANES, |w: &Panels, r0, r1, out| {
        // SAFETY: the caller's promise; r0 is a multiple of 16 and r1 <= n,
        // so the panels lie inside `w`.
        unsafe { super::dpbf16::panels::rows::<K>(w, x, out, r0 / LANES..r1.div_ceil(LANES)) };
    });
}

#[cfg(not(target_arch = "x86_64"))]
fn run(x: &[f32], m: usize, _k: usize, parts: &mut [PanelLinear<'_>]) {
    reference(x, m, parts)
}

/// The same sums, one output at a time, in the kernel's order (where the
/// CPU lacks it: panels are packed only where it runs).
fn reference(x: &[f32], m: usize, parts: &mut [PanelLinear<'_>]) {
    for p in parts.iter_mut() {
        let (n, k, pairs) = (p.w.rows, p.w.cols, p.w.pairs());
        let packed = p.w.packed();
        for t in 0..m {
            let xs: Vec<f32> = (0..2 * pairs)
                .map(|c| {
                    x.get(t * k + c)
                        .filter(|_| c < k)
                        .map_or(0.0, |&v| bf16::from_f32(v).to_f32())
                })
                .collect();
            for r in 0..n {
                let panel = &packed[(r / LANES) * p.w.panel_len()..];
                let mut acc = 0f32;
                for j in 0..pairs {
                    let w = &panel[(j * LANES + r % LANES) * 2..][..2];
                    acc += w[0].to_f32() * xs[2 * j] + w[1].to_f32() * xs[2 * j + 1];
                }
                p.out[t * n + r] = acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values as pseudo;

    fn matrix(n: usize, k: usize, seed: u32) -> Matrix {
        let data: Vec<bf16> = pseudo(n * k, seed)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        Matrix {
            rows: n,
            cols: k,
            data: WeightData::Bf16(Buf::from(data)),
        }
    }

    #[test]
    fn packing_round_trips() {
        for (n, k) in [(37, 81), (16, 64), (1, 1), (64, 576)] {
            let w = matrix(n, k, 5);
            let p = Panels::pack(&w).expect("bf16 packs");
            let back = p.to_matrix();
            let (WeightData::Bf16(a), WeightData::Bf16(b)) = (&w.data, &back.data) else {
                panic!("bf16 in, bf16 out");
            };
            assert_eq!(&a[..], &b[..], "n{n} k{k}");
            assert_eq!(p.bytes(), n.div_ceil(16) * 16 * k.next_multiple_of(2) * 2);
        }
    }

    /// Every tile shape (4 and 1 panels, 1–6 tokens, several token tiles,
    /// a partial last panel, an odd k) against f64 sums of the rounded
    /// inputs; each token's outputs identical alone and in the batch; two
    /// parts in one call each as alone.
    #[test]
    fn sums_match_the_rounded_products_and_do_not_depend_on_the_batch() {
        for (n, k, m) in [
            (37, 81, 11),
            (16, 64, 1),
            (150, 32, 7),
            (5, 200, 3),
            (96, 70, 13),
        ] {
            let w = matrix(n, k, 1);
            let p = Panels::pack(&w).expect("bf16 packs");
            let x = pseudo(m * k, 2);
            let mut out = vec![0f32; m * n];
            linear_panels(
                &x,
                m,
                &mut [PanelLinear {
                    w: &p,
                    bias: None,
                    out: &mut out,
                }],
            );
            let WeightData::Bf16(wd) = &w.data else {
                unreachable!()
            };
            for t in 0..m {
                for r in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| wd[r * k + c].to_f64() * bf16::from_f32(x[t * k + c]).to_f64())
                        .sum();
                    let got = out[t * n + r] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "n{n} k{k} t{t} r{r}: {got} vs {want}"
                    );
                }
                let mut one = vec![0f32; n];
                let alone = &x[t * k..(t + 1) * k];
                linear_panels(
                    alone,
                    1,
                    &mut [PanelLinear {
                        w: &p,
                        bias: None,
                        out: &mut one,
                    }],
                );
                assert_eq!(one, out[t * n..(t + 1) * n], "n{n} k{k} token {t}");
            }
            // Fused with a second part, with a bias.
            let w2 = Panels::pack(&matrix(21, k, 3)).expect("bf16 packs");
            let bias: Vec<f32> = (0..21).map(|i| i as f32).collect();
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * 21]);
            linear_panels(
                &x,
                m,
                &mut [
                    PanelLinear {
                        w: &p,
                        bias: None,
                        out: &mut a,
                    },
                    PanelLinear {
                        w: &w2,
                        bias: Some(&bias),
                        out: &mut b,
                    },
                ],
            );
            assert_eq!(a, out, "n{n} k{k}: fused");
            let mut b_alone = vec![0f32; m * 21];
            linear_panels(
                &x,
                m,
                &mut [PanelLinear {
                    w: &w2,
                    bias: None,
                    out: &mut b_alone,
                }],
            );
            for (i, (got, plain)) in b.iter().zip(&b_alone).enumerate() {
                assert_eq!(*got, plain + (i % 21) as f32, "n{n} k{k}: bias");
            }
        }
    }

    /// Where the CPU runs the kernel, it and the portable loop agree to
    /// rounding (they add in different orders inside a pair).
    #[test]
    fn the_kernel_agrees_with_the_portable_loop() {
        let (n, k, m) = (70, 130, 9);
        let p = Panels::pack(&matrix(n, k, 7)).expect("bf16 packs");
        let x = pseudo(m * k, 8);
        let (mut fast, mut slow) = (vec![0f32; m * n], vec![0f32; m * n]);
        linear_panels(
            &x,
            m,
            &mut [PanelLinear {
                w: &p,
                bias: None,
                out: &mut fast,
            }],
        );
        reference(
            &x,
            m,
            &mut [PanelLinear {
                w: &p,
                bias: None,
                out: &mut slow,
            }],
        );
        for (a, b) in fast.iter().zip(&slow) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}
