//! Which decode batch sizes get a captured CUDA graph.
//!
//! Small-batch decode is launch-bound: a Llama layer is a dozen kernels and
//! cuBLAS calls, each a few microseconds to launch. A graph replays them all
//! with one launch. Graphs are captured for a fixed set of sizes (1, 2, 4,
//! then every multiple of 8, as vLLM does) and a decode batch runs the
//! smallest captured size that holds it, its extra rows padding.

/// The captured decode batch sizes, ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphSizes {
    sizes: Vec<usize>,
}

impl GraphSizes {
    /// 1, 2, 4, then multiples of 8 up to `max` (and `max` itself).
    pub fn up_to(max: usize) -> Self {
        let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s <= max).collect();
        sizes.extend((8..=max).step_by(8));
        if max > 0 && sizes.last() != Some(&max) {
            sizes.push(max);
        }
        Self { sizes }
    }

    /// The smallest captured size that holds `batch`, or `None` (run eagerly).
    pub fn pick(&self, batch: usize) -> Option<usize> {
        if batch == 0 {
            return None;
        }
        let i = self.sizes.partition_point(|&s| s < batch);
        self.sizes.get(i).copied()
    }

    /// Every captured size.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_powers_of_two_then_multiples_of_eight() {
        assert_eq!(GraphSizes::up_to(20).sizes(), &[1, 2, 4, 8, 16, 20]);
        assert_eq!(GraphSizes::up_to(3).sizes(), &[1, 2, 3]);
        assert_eq!(GraphSizes::up_to(0).sizes(), &[] as &[usize]);
    }

    #[test]
    fn a_batch_pads_to_the_next_captured_size() {
        let g = GraphSizes::up_to(256);
        assert_eq!(g.pick(1), Some(1));
        assert_eq!(g.pick(3), Some(4));
        assert_eq!(g.pick(9), Some(16));
        assert_eq!(g.pick(256), Some(256));
        assert_eq!(g.pick(257), None);
        assert_eq!(g.pick(0), None);
    }
}
