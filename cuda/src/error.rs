//! Errors of the CUDA backend.

/// What can go wrong on the GPU path.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A batch the backend cannot run (it names the sequence and the reason).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The model or options do not fit this backend.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed.
    #[error("CUDA {what}: {detail}")]
    Driver { what: &'static str, detail: String },
    /// The engine refused the checkpoint.
    #[error(transparent)]
    Engine(#[from] tandem_engine::EngineError),
}

impl CudaError {
    /// Wraps a failed CUDA call.
    pub fn driver(what: &'static str, err: impl std::fmt::Debug) -> Self {
        Self::Driver {
            what,
            detail: format!("{err:?}"),
        }
    }
}
