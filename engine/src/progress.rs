//! Progress of long load-time work (reading a checkpoint's layers,
//! quantizing them to INT4) for whoever is watching.
//!
//! The engine is a library: it does not draw anything. A binary installs one
//! process-wide [`ProgressSink`] with [`set_sink`] (the `tandem` command
//! line draws terminal progress bars with it); without one, reporting costs
//! one atomic load per step. Work reports through a [`Task`], an RAII guard
//! that begins on creation and finishes when dropped, so an error part-way
//! through still closes the bar.

use std::sync::OnceLock;

/// Where progress goes. Implementations must be cheap: `advance` is called
/// once per layer.
pub trait ProgressSink: Send + Sync {
    /// A task of `total` steps named `what` (e.g. `loading layers`) begins.
    fn begin(&self, what: &str, total: u64);
    /// `steps` more of the current task are done.
    fn advance(&self, steps: u64);
    /// The current task ended (done or failed).
    fn finish(&self);
}

static SINK: OnceLock<Box<dyn ProgressSink>> = OnceLock::new();

/// Installs the process's sink. The first call wins; a later one gets its
/// sink back.
pub fn set_sink(sink: Box<dyn ProgressSink>) -> Result<(), Box<dyn ProgressSink>> {
    SINK.set(sink)
}

/// One reported task; finishes when dropped.
pub struct Task {
    sink: Option<&'static dyn ProgressSink>,
}

impl Task {
    /// Begins `what`, `total` steps long.
    pub fn begin(what: &str, total: u64) -> Self {
        let sink = SINK.get().map(|s| &**s);
        if let Some(s) = sink {
            s.begin(what, total);
        }
        Self { sink }
    }

    /// One more step done.
    pub fn step(&self) {
        if let Some(s) = self.sink {
            s.advance(1);
        }
    }
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("reported", &self.sink.is_some())
            .finish()
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        if let Some(s) = self.sink {
            s.finish();
        }
    }
}
