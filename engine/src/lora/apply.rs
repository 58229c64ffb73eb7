//! Applying one step's adapters: each row's low-rank update, added after
//! the base projection.
//!
//! Rows are grouped by adapter (Punica's SGMV shape, on a CPU): each group,
//! in chunks of at most [`CHUNK_ROWS`] rows, reads its adapter's `A` and
//! `Bᵀ` once for all its rows instead of once per row — at batch 32 with 8
//! adapters, a quarter of the bytes. Chunks run in parallel, each into its
//! own buffer, then are added to their rows in order.

use rayon::prelude::*;

use super::{LoraAdapter, LoraTarget};
use crate::kernels::add_in_place;

/// Rows of one adapter that one task updates together.
const CHUNK_ROWS: usize = 8;

/// One step's rows grouped by adapter.
#[derive(Debug, Default)]
pub(crate) struct LoraRows<'a> {
    /// Rows in the step.
    rows: usize,
    /// An adapter and up to `CHUNK_ROWS` of its rows, ascending.
    chunks: Vec<(&'a LoraAdapter, Vec<usize>)>,
}

impl<'a> LoraRows<'a> {
    /// `rows[i]` is row `i`'s adapter.
    pub(crate) fn new(rows: Vec<Option<&'a LoraAdapter>>) -> Self {
        let mut groups: Vec<(&'a LoraAdapter, Vec<usize>)> = Vec::new();
        for (i, adapter) in rows.iter().enumerate() {
            let Some(a) = *adapter else { continue };
            match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, a)) {
                Some((_, members)) => members.push(i),
                None => groups.push((a, vec![i])),
            }
        }
        let chunks = groups
            .into_iter()
            .flat_map(|(a, members)| {
                let chunks: Vec<Vec<usize>> =
                    members.chunks(CHUNK_ROWS).map(<[usize]>::to_vec).collect();
                chunks.into_iter().map(move |c| (a, c))
            })
            .collect();
        Self {
            rows: rows.len(),
            chunks,
        }
    }

    /// Whether any row has an adapter.
    pub(crate) fn any(&self) -> bool {
        !self.chunks.is_empty()
    }

    /// One layer's view.
    pub(crate) fn layer(&self, layer: usize) -> LayerLora<'_> {
        LayerLora { rows: self, layer }
    }
}

/// The adapters of one step at one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerLora<'a> {
    rows: &'a LoraRows<'a>,
    layer: usize,
}

/// No row has an adapter.
static NO_ROWS: LoraRows<'static> = LoraRows {
    rows: 0,
    chunks: Vec::new(),
};

impl LayerLora<'_> {
    /// No adapter at all (experts, shared experts).
    pub(crate) const NONE: LayerLora<'static> = LayerLora {
        rows: &NO_ROWS,
        layer: 0,
    };

    /// Adds each row's adapter update of `target` to `out` (`m × out`),
    /// given the layer's input `x` (`m × in`).
    pub(crate) fn apply(&self, target: LoraTarget, x: &[f32], out: &mut [f32]) {
        let (chunks, m) = (&self.rows.chunks, self.rows.rows);
        if chunks.is_empty() || m == 0 {
            return;
        }
        let outp = out.len() / m;
        let layer = self.layer;
        let delta =
            |(a, rows): &(&LoraAdapter, Vec<usize>)| Some(a.pair(layer, target)?.delta(x, rows));
        // One chunk (a decode batch of one adapter) runs here: a parallel
        // loop would cost a hand-off to the pool for microseconds of work.
        let deltas: Vec<Option<Vec<f32>>> = match chunks.len() {
            1 => chunks.iter().map(delta).collect(),
            _ => chunks.par_iter().map(delta).collect(),
        };
        for ((_, rows), delta) in chunks.iter().zip(deltas) {
            let Some(delta) = delta else { continue };
            for (&r, d) in rows.iter().zip(delta.chunks_exact(outp)) {
                add_in_place(&mut out[r * outp..(r + 1) * outp], d);
            }
        }
    }
}
