//! The kernels compile: NVRTC turns `kernels.cu` into PTX for the GPU
//! generations tandem targets, and every kernel the backend loads is an
//! entry point of that PTX.
//!
//! NVRTC needs no GPU, so this runs on CPU-only machines that have
//! `libnvrtc` on the library path (`.ci/run` installs it from PyPI's
//! `nvidia-cuda-nvrtc`). Without the library the test says so and passes,
//! unless `TANDEM_REQUIRE_NVRTC` is set (as `.ci/run` does), when it fails.
//! A kernel edit that does not compile is caught here instead of on the
//! next GPU machine.
#![cfg(feature = "cuda")]

use tandem_cuda::{ptx, KERNEL_NAMES};

/// Ampere (A100), Ada (L40S), Hopper (H100, H200), Blackwell (B200).
const ARCHES: &[&str] = &["sm_80", "sm_89", "sm_90", "sm_100"];

#[test]
fn every_kernel_compiles_for_every_target_architecture() {
    if !ptx::nvrtc_available() {
        assert!(
            std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
            "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!(
            "skipped: libnvrtc not found; the kernel compile check is \
             `cargo test -p tandem-cuda --features cuda --test kernels_compile` with it on LD_LIBRARY_PATH"
        );
        return;
    }
    for arch in ARCHES {
        let text = ptx::compile(arch).unwrap_or_else(|e| panic!("kernels.cu for {arch}: {e}"));
        assert!(
            text.contains(&format!(".target {arch}")),
            "the PTX for {arch} names another target"
        );
        let entries: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split(".entry ").nth(1))
            .map(|rest| rest.split(['(', ' ']).next().unwrap_or(""))
            .collect();
        for name in KERNEL_NAMES {
            assert!(
                entries.contains(name),
                "{arch}: kernel {name} is not an entry point of the PTX (entries: {entries:?})"
            );
        }
    }
}
