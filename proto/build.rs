//! Generates the tonic clients and servers and the prost messages for the
//! public API (`proto/tandem/v1`) and the worker-internal API
//! (`proto/tandem/worker/v1`), each with its own file descriptor set so a
//! server reflects only the services it serves.

use std::path::PathBuf;

const INCLUDES: &[&str] = &["proto"];

/// (proto files, descriptor set file name). The worker API imports
/// `generate.proto`, and compiling it writes `tandem.v1.rs` with that file's
/// messages only: the public package comes last, so its module holds all of
/// `tandem.v1`.
const PACKAGES: &[(&[&str], &str)] = &[
    (
        &["proto/tandem/worker/v1/worker.proto"],
        "tandem_worker_v1_descriptor.bin",
    ),
    (
        &[
            "proto/tandem/v1/generate.proto",
            "proto/tandem/v1/chat.proto",
        ],
        "tandem_v1_descriptor.bin",
    ),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    for (protos, descriptor) in PACKAGES {
        for proto in *protos {
            println!("cargo:rerun-if-changed={proto}");
        }
        tonic_prost_build::configure()
            .build_client(true)
            .build_server(true)
            .file_descriptor_set_path(out_dir.join(descriptor))
            .compile_protos(protos, INCLUDES)?;
    }
    Ok(())
}
