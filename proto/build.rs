//! Compiles `corral/v1/*.proto` with protox (pure Rust: no system `protoc`)
//! into prost messages (and, with the `grpc` feature, tonic stubs) in
//! `OUT_DIR`, plus the encoded descriptor set served through reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "corral/v1/worker.proto",
        "corral/v1/init.proto",
        "corral/v1/control.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("corral_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    #[cfg(feature = "grpc")]
    tonic_prost_build::configure()
        .bytes(".")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    #[cfg(not(feature = "grpc"))]
    prost_build::Config::new().bytes(["."]).compile_fds(fds)?;
    Ok(())
}
