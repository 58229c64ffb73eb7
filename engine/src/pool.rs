//! A forward pass on rayon's pool with the pool's other threads kept
//! awake until it returns.
//!
//! A decode step is a chain of small parallel regions (SmolLM2-135M: about
//! 150 a step, one per linear and attention call, 40–100 µs each at batch
//! 1). Between two regions a rayon worker with nothing to steal yields for a
//! few rounds and then sleeps on a futex; the next region has to wake it,
//! and on the VMs this project measures on that costs 14–38 µs a region
//! (a probe: 8 tasks of 5 µs with 30 µs of serial work between regions ran
//! 14–24 µs over the ideal per region; with the worker kept awake, 3–4 µs).
//! [`run_step`] spawns, beside the pass, one job per other thread that
//! spins on [`rayon::yield_now`] (running whatever work appears: the pass's
//! own tasks) until the pass returns, as llama.cpp's threads spin on their
//! barrier for a graph's length. The spin ends with the pass, so an idle
//! server sleeps as before.
//!
//! **Deadlock freedom.** A spinner returns only when the pass does, so it
//! must never sit on top of a frame the pass waits for: [`run_step`] starts
//! the pass only once the spinners are taken (or a short wait has passed),
//! and a spinner taken after that returns at once (`admit`). Before the
//! pass starts it has made no jobs, so nothing a spinner sits on is the
//! pass's. One pass at a time spins (`SPINNING`); another, concurrent, runs
//! as a plain scope, so no two spinners can wait on each other's passes. A
//! pass that panics still stops its spinners (the scope waits for them
//! before the panic goes on).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a pass waits for its spinners to be taken before it starts
/// without the ones still queued (a sleeping worker wakes in tens of
/// microseconds; one busy with other work may take longer).
const ADMIT_WAIT: Duration = Duration::from_micros(500);

/// Idle polls a spinner makes between two `sched_yield`s, so threads
/// outside the pool (the server's I/O) get a turn on a busy core.
const POLLS_PER_YIELD: u32 = 64;

/// Whether some pass's spinners are running (one pass at a time).
static SPINNING: AtomicBool = AtomicBool::new(false);

/// Runs `pass` on a thread of rayon's global pool (this one, if it is
/// one), with the pool's other threads kept from sleeping until it
/// returns.
pub fn run_step<R: Send>(pass: impl FnOnce() -> R + Send) -> R {
    let spin = Spin {
        admit: AtomicBool::new(true),
        stop: AtomicBool::new(false),
        taken: AtomicUsize::new(0),
    };
    let shared = &spin;
    rayon::scope(|scope| {
        let others = rayon::current_num_threads().saturating_sub(1);
        let Some(_turn) = SpinTurn::take().filter(|_| others > 0) else {
            return pass();
        };
        for _ in 0..others {
            scope.spawn(move |_| shared.keep_awake());
        }
        // Set even if the pass panics: the scope waits for the spinners.
        let _stop = StopOnDrop(shared);
        let start = Instant::now();
        while shared.taken.load(Ordering::Acquire) < others && start.elapsed() < ADMIT_WAIT {
            std::hint::spin_loop();
        }
        // A spinner not taken by now may be taken later from inside one of
        // the pass's own tasks: it must not spin there.
        shared.admit.store(false, Ordering::Release);
        pass()
    })
}

/// The one pass that spins: taken with [`SpinTurn::take`], given back
/// when the pass has returned (its spinners, told to stop first, are on
/// their way out; a later pass's spinners never wait on them).
struct SpinTurn;

impl SpinTurn {
    fn take() -> Option<Self> {
        SPINNING
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(Self)
    }
}

impl Drop for SpinTurn {
    fn drop(&mut self) {
        SPINNING.store(false, Ordering::Release);
    }
}

/// Tells a pass's spinners to return, when the pass has (or panicked).
struct StopOnDrop<'a>(&'a Spin);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Release);
    }
}

/// One pass's spinners' shared state.
struct Spin {
    /// Whether a spinner taken now may spin (until the pass starts).
    admit: AtomicBool,
    /// Set when the pass has returned.
    stop: AtomicBool,
    /// Spinners taken so far.
    taken: AtomicUsize,
}

impl Spin {
    /// Runs the pool's work as it appears until the pass returns.
    fn keep_awake(&self) {
        if !self.admit.load(Ordering::Acquire) {
            return;
        }
        self.taken.fetch_add(1, Ordering::AcqRel);
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            match rayon::yield_now() {
                Some(rayon::Yield::Executed) => idle = 0,
                _ => {
                    idle += 1;
                    if idle.is_multiple_of(POLLS_PER_YIELD) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn parallel_sum(n: u64) -> u64 {
        (0..n).into_par_iter().map(|i| i * i).sum()
    }

    /// The pass runs on a pool thread and its parallel regions complete.
    #[test]
    fn a_pass_runs_on_the_pool_and_its_regions_complete() {
        let want: u64 = (0..10_000u64).map(|i| i * i).sum();
        let (on_pool, sums) = run_step(|| {
            let sums: Vec<u64> = (0..200).map(|_| parallel_sum(10_000)).collect();
            (rayon::current_thread_index().is_some(), sums)
        });
        assert!(on_pool);
        assert!(sums.iter().all(|&s| s == want));
    }

    /// A spinner taken after its pass has started returns at once, without
    /// counting itself; one taken before spins until the pass returns.
    #[test]
    fn a_spinner_spins_only_if_taken_before_the_pass() {
        let late = Spin {
            admit: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            taken: AtomicUsize::new(0),
        };
        late.keep_awake();
        assert_eq!(late.taken.load(Ordering::Acquire), 0);
        let early = Spin {
            admit: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            taken: AtomicUsize::new(0),
        };
        std::thread::scope(|s| {
            let spinner = s.spawn(|| early.keep_awake());
            while early.taken.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
            std::thread::sleep(Duration::from_millis(20));
            assert!(!spinner.is_finished(), "it spins while the pass runs");
            early.stop.store(true, Ordering::Release);
            spinner.join().expect("the spinner returns");
        });
    }

    /// Passes from several threads at once, nested regions in each, and a
    /// pass inside a pass: every one finishes (one spins, the others run as
    /// plain scopes), within a bound.
    #[test]
    fn concurrent_and_nested_passes_finish() {
        let (done, finished) = std::sync::mpsc::channel();
        for t in 0..4u64 {
            let done = done.clone();
            std::thread::spawn(move || {
                let total: u64 = (0..50)
                    .map(|i| {
                        run_step(|| {
                            let inner = run_step(|| parallel_sum(1000 + t));
                            (0..8u64)
                                .into_par_iter()
                                .map(|j| parallel_sum(100 + j + i))
                                .sum::<u64>()
                                + inner
                        })
                    })
                    .sum();
                done.send(total).expect("the test waits");
            });
        }
        drop(done);
        for _ in 0..4 {
            finished
                .recv_timeout(Duration::from_secs(60))
                .expect("every pass finishes");
        }
    }
}
