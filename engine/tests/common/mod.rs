//! Helpers shared by the engine's integration tests.

use tandem_engine::{synth, DType, Model};

/// Writes a random preset checkpoint into a fresh temporary directory and
/// loads it; the directory lives as long as the returned guard.
pub fn synth_model(preset: &str, seed: u64, dtype: DType) -> (tempfile::TempDir, Model) {
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::preset(preset)
        .expect("preset")
        .write(tmp.path(), seed, dtype)
        .expect("write checkpoint");
    let model = Model::load(tmp.path()).expect("load checkpoint");
    (tmp, model)
}
