//! The kernels' source and the on-disk PTX cache.
//!
//! NVRTC compiles `kernels.cu` once per (source, target architecture,
//! options); the PTX is cached under a key hashing all three, so a restart
//! skips the compile and an edited kernel or a different GPU never reuses a
//! stale module.

use std::path::{Path, PathBuf};

/// The CUDA C++ source of every kernel.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// NVRTC options besides the architecture.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17"];

/// The `--gpu-architecture` for a compute capability (`(9, 0)` → `sm_90`).
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// Cache key: FNV-1a over the source, the architecture and the options.
pub fn cache_key(source: &str, arch: &str, options: &[&str]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    feed(source.as_bytes());
    feed(arch.as_bytes());
    for o in options {
        feed(o.as_bytes());
    }
    format!("{arch}-{h:016x}")
}

/// `$TANDEM_PTX_CACHE`, else `$XDG_CACHE_HOME/tandem/ptx`, else
/// `~/.cache/tandem/ptx`, else the system temp dir.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_PTX_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tandem").join("ptx")
}

/// The cached PTX for `key`, if any.
pub fn load_cached(dir: &Path, key: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(format!("{key}.ptx"))).ok()
}

/// Stores PTX under `key` (write to a temp name, then rename, so a reader
/// never sees half a file). Failure only costs a recompile next time.
pub fn store_cached(dir: &Path, key: &str, ptx: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{key}.ptx.{}", std::process::id()));
    std::fs::write(&tmp, ptx)?;
    std::fs::rename(tmp, dir.join(format!("{key}.ptx")))
}

/// Whether NVRTC (`libnvrtc`) can be loaded here. It needs no GPU: the
/// kernels compile on any machine that has the library.
#[cfg(feature = "cuda")]
pub fn nvrtc_available() -> bool {
    // SAFETY: loads a shared library by name (running its initialisers);
    // NVRTC is made to be loaded so.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`KERNELS_CU`] with NVRTC for `arch` (`sm_90`) and returns the
/// PTX. A compile error carries NVRTC's log. Panics (cudarc) if NVRTC cannot
/// be loaded: check [`nvrtc_available`] first.
#[cfg(feature = "cuda")]
pub fn compile(arch: &str) -> Result<String, crate::CudaError> {
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    cudarc::nvrtc::compile_ptx_with_opts(
        KERNELS_CU,
        cudarc::nvrtc::CompileOptions {
            options,
            ..Default::default()
        },
    )
    .map(|ptx| ptx.to_src())
    .map_err(|e| crate::CudaError::driver("NVRTC compile", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_changes_with_source_arch_and_options() {
        let base = cache_key("src", "sm_90", &["-O3"]);
        assert_eq!(base, cache_key("src", "sm_90", &["-O3"]));
        assert!(base.starts_with("sm_90-"));
        assert_ne!(base, cache_key("src2", "sm_90", &["-O3"]));
        assert_ne!(base, cache_key("src", "sm_80", &["-O3"]));
        assert_ne!(base, cache_key("src", "sm_90", &[]));
        assert_ne!(cache_key("ab", "c", &[]), cache_key("a", "bc", &[]));
    }

    #[test]
    fn cached_ptx_round_trips() {
        let dir = tempfile::tempdir().expect("temp dir");
        let key = cache_key(KERNELS_CU, "sm_90", NVRTC_OPTIONS);
        assert_eq!(load_cached(dir.path(), &key), None);
        store_cached(dir.path(), &key, ".version 8.0").expect("store");
        assert_eq!(
            load_cached(dir.path(), &key).as_deref(),
            Some(".version 8.0")
        );
    }

    #[test]
    fn arch_names_follow_nvrtc() {
        assert_eq!(arch_for(9, 0), "sm_90");
        assert_eq!(arch_for(8, 6), "sm_86");
    }

    #[test]
    fn every_kernel_the_backend_loads_is_in_the_source() {
        for name in crate::KERNEL_NAMES {
            let call = format!(" {name}(");
            let base = name.strip_suffix("_decode").unwrap_or(name);
            let instantiated = format!("ATTN_KERNEL({base},");
            assert!(
                KERNELS_CU.lines().any(|l| {
                    (l.starts_with("extern \"C\" __global__") && l.contains(&call))
                        || l.starts_with(&instantiated)
                }),
                "kernel {name} is not defined in kernels.cu"
            );
        }
    }
}
