//! Generates the tonic client and server and the prost messages for
//! `proto/tandem/v1/*.proto`, plus a file descriptor set for gRPC reflection.

use std::path::PathBuf;

const PROTOS: &[&str] = &["proto/tandem/v1/generate.proto"];
const INCLUDES: &[&str] = &["proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out_dir.join("tandem_v1_descriptor.bin"))
        .compile_protos(PROTOS, INCLUDES)?;
    Ok(())
}
