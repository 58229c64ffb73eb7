//! What `tandem up` prints once its cluster is ready: the lines scripts
//! and tests read on stdout (`decode worker ADDR PID`, `metrics ...`,
//! `http listening on ADDR`, and `listening on ADDR` last), the same for
//! people on stderr, and the "Try it" block.

use super::{TlsDir, UpArgs};

/// What a started cluster tells the person and the scripts reading it.
pub(super) struct Announcement<'a> {
    /// etcd's endpoint, the cluster's name and etcd's pid, when `up` runs one.
    pub etcd: Option<(&'a str, &'a str, u32)>,
    pub args: &'a UpArgs,
    pub model: &'a str,
    pub tls: Option<&'a TlsDir>,
    /// (gRPC address, pid) of each worker.
    pub decodes: &'a [(String, u32)],
    pub prefills: &'a [(String, u32)],
    /// (role, gRPC address, metrics address) of every process.
    pub metrics: &'a [(&'static str, String, String)],
    /// The router's gRPC and HTTP addresses.
    pub addr: &'a str,
    pub http: Option<&'a str>,
}

/// Prints the cluster: machine-read lines on stdout (the workers, then
/// `listening on` last), the same for people on stderr, then "Try it".
pub(super) fn announce(a: &Announcement<'_>) {
    if let Some((endpoint, cluster, pid)) = a.etcd {
        println!("etcd {endpoint} {cluster} {pid}");
    }
    let addrs = |w: &[(String, u32)]| w.iter().map(|(x, _)| x.clone()).collect::<Vec<_>>();
    if let Some(t) = a.tls {
        eprintln!(
            "mutual TLS: clients need {0}/ca.pem and a certificate from it, e.g. {0}/client.pem with {0}/client.key",
            t.certs.dir.display()
        );
        println!("tls {}", t.certs.dir.display());
    }
    eprintln!(
        "tandem cluster: {} decode ({}), {} prefill ({}); router on {}",
        a.decodes.len(),
        addrs(a.decodes).join(", "),
        a.prefills.len(),
        addrs(a.prefills).join(", "),
        a.addr
    );
    for (d, pid) in a.decodes {
        println!("decode worker {d} {pid}");
    }
    for (p, pid) in a.prefills {
        println!("prefill worker {p} {pid}");
    }
    for (role, grpc, m) in a.metrics {
        eprintln!("{role} {grpc}: Prometheus metrics on http://{m}/metrics");
        println!("metrics {role} {grpc} {m}");
    }
    if let Some(h) = a.http {
        eprintln!("OpenAI-compatible HTTP API on http://{h}/v1");
        println!("http listening on {h}");
    }
    let args = a.args;
    let model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| tandem_engine::checkpoint::model_name(std::path::Path::new(a.model)));
    let exe = std::env::args().next().unwrap_or_else(|| "tandem".into());
    let tls_dir = a.tls.map(|t| t.certs.dir.display().to_string());
    eprint!(
        "{}",
        super::try_it::render(&super::try_it::Cluster {
            exe: &exe,
            grpc: a.addr,
            http: a.http,
            model_dir: args.model.as_ref().map(|_| a.model),
            model_name: &model_name,
            tls_dir: tls_dir.as_deref(),
            api_key: !args.api_keys.api_keys.is_empty() || args.api_keys.api_keys_file.is_some(),
        })
    );
    println!("listening on {}", a.addr);
}
