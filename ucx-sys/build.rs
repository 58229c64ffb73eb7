//! Generates bindings to `ucp/api/ucp.h` of the system's UCX (pkg-config
//! `ucx`, at least 1.12) and links `libucp`, `libuct`, `libucs`.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let ucx = match pkg_config::Config::new()
        .atleast_version("1.12")
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => {
            eprintln!(
                "tandem-ucx-sys: UCX (pkg-config `ucx`, >= 1.12) not found: {e}\n\
                 Install it: apt-get install libucx-dev (bindgen also needs libclang-dev)."
            );
            std::process::exit(1);
        }
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .newtype_enum("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("tandem-ucx-sys: bindgen failed on ucp/api/ucp.h: {e}");
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    if let Err(e) = bindings.write_to_file(out.join("bindings.rs")) {
        eprintln!("tandem-ucx-sys: writing the bindings: {e}");
        std::process::exit(1);
    }
}
