//! The Kubernetes manifests under `deploy/`, rendered by the real kustomize
//! (`kubectl kustomize`, or `kustomize build`), checked against each other
//! and against the binary:
//!
//! - cross-references: selectors match pod labels and no two workloads
//!   share pods; Services, probes and NetworkPolicies name container ports
//!   that exist, and the ports the binaries listen on (read from their
//!   parsed arguments); the etcd address names the etcd Service; mounts,
//!   volumes, ConfigMaps, Secrets, the ServiceAccount and HPA targets exist;
//!   the KV-transfer port is open only to prefill workers;
//! - every argument and environment variable given to `tandem` is accepted
//!   by its own clap definitions (`tandem_cli::Cli`);
//! - the `cpu` overlay's etcd members, router and workers, started as local
//!   processes with exactly the manifests' arguments and environment
//!   (`$(VAR)` expanded as the kubelet does; member DNS names and ports
//!   moved to free loopback ports, volumes to temporary directories, the
//!   etcd Service to its members' URLs), pass their probes and serve a
//!   request through the router with the prompt prefilled remotely.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine as _;
use clap::{CommandFactory, Parser};
use serde::Deserialize;
use serde_yaml::Value;
use tandem_cli::Cli;
use tandem_proto::v1;
use tandem_proto::v1::generation_client::GenerationClient;
use tandem_proto::worker::{ROUTED_DECODE_HEADER, ROUTED_PREFILL_HEADER};
use tandem_tests::cluster::{free_port, load, KillOnDrop};

/// Every overlay an operator can apply.
const OVERLAYS: &[&str] = &["cpu", "cpu-planner", "gpu", "gpu-pipeline"];

/// The Secret operators create themselves (deploy/README.md); every other
/// reference must resolve inside the rendered manifests.
const OPERATOR_SECRET: &str = "tandem-cluster-token";

/// Variables tandem reads itself rather than as a flag's `env`: secrets.
const SECRET_ENV: [&str; 1] = ["TANDEM_CLUSTER_TOKEN"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// `kubectl kustomize deploy/overlays/<overlay>` as YAML documents.
fn render(overlay: &str) -> Vec<Value> {
    let dir = repo().join("deploy/overlays").join(overlay);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .or_else(|_| Command::new("kustomize").arg("build").arg(&dir).output())
        .expect("rendering the overlays needs kubectl (or kustomize) on PATH");
    assert!(
        out.status.success(),
        "kustomize {overlay}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| Value::deserialize(d).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// `v` at a dotted path (`spec.template.spec`).
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

fn s<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {path} in {v:?}"))
}

fn seq<'a>(v: &'a Value, path: &str) -> &'a [Value] {
    at(v, path)
        .and_then(Value::as_sequence)
        .map_or(&[], Vec::as_slice)
}

fn labels(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_mapping)
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s.clone(),
                        other => serde_yaml::to_string(other).expect("label").trim().into(),
                    };
                    (k.as_str().expect("label key").to_string(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn selects(selector: &BTreeMap<String, String>, pod: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| pod.get(k) == Some(v))
}

fn name(v: &Value) -> String {
    s(v, "metadata.name").to_string()
}

fn kind(v: &Value) -> &str {
    s(v, "kind")
}

/// A rendered overlay.
struct Manifests {
    overlay: String,
    objs: Vec<Value>,
}

/// A pod template and what owns it.
struct Workload<'a> {
    kind: String,
    name: String,
    obj: &'a Value,
    pod: &'a Value,
    labels: BTreeMap<String, String>,
}

/// Where an environment variable's value comes from.
#[derive(Debug, Clone)]
enum EnvSource {
    Literal(String),
    Field(String),
    Secret { name: String, key: String },
}

impl Manifests {
    fn load(overlay: &str) -> Self {
        Self {
            overlay: overlay.to_string(),
            objs: render(overlay),
        }
    }

    fn of_kind(&self, k: &str) -> impl Iterator<Item = &Value> + '_ {
        let k = k.to_string();
        self.objs.iter().filter(move |o| kind(o) == k)
    }

    fn find(&self, k: &str, n: &str) -> Option<&Value> {
        self.of_kind(k).find(|o| name(o) == n)
    }

    fn workloads(&self) -> Vec<Workload<'_>> {
        self.objs
            .iter()
            .filter(|o| matches!(kind(o), "Deployment" | "StatefulSet"))
            .map(|o| {
                let pod = at(o, "spec.template").expect("pod template");
                Workload {
                    kind: kind(o).to_string(),
                    name: name(o),
                    obj: o,
                    pod: at(pod, "spec").expect("pod spec"),
                    labels: labels(at(pod, "metadata.labels")),
                }
            })
            .collect()
    }

    fn workload(&self, n: &str) -> Workload<'_> {
        self.workloads()
            .into_iter()
            .find(|w| w.name == n)
            .unwrap_or_else(|| panic!("{}: no workload {n}", self.overlay))
    }

    /// The workloads whose pods `selector` selects (matchLabels only: the
    /// manifests use no expressions).
    fn selected(&self, selector: &BTreeMap<String, String>) -> Vec<Workload<'_>> {
        assert!(!selector.is_empty(), "{}: an empty selector", self.overlay);
        self.workloads()
            .into_iter()
            .filter(|w| selects(selector, &w.labels))
            .collect()
    }

    /// A container's environment, in Kubernetes' order: envFrom, then env
    /// (which wins).
    fn env(&self, c: &Value) -> BTreeMap<String, EnvSource> {
        let mut env = BTreeMap::new();
        for from in seq(c, "envFrom") {
            let cm = s(from, "configMapRef.name");
            let cm = self
                .find("ConfigMap", cm)
                .unwrap_or_else(|| panic!("{}: no ConfigMap {cm}", self.overlay));
            for (k, v) in at(cm, "data").and_then(Value::as_mapping).expect("data") {
                let v = v.as_str().expect("ConfigMap values are strings");
                env.insert(
                    k.as_str().expect("key").into(),
                    EnvSource::Literal(v.into()),
                );
            }
        }
        for e in seq(c, "env") {
            let src = if let Some(v) = at(e, "value") {
                EnvSource::Literal(v.as_str().expect("string value").into())
            } else if let Some(f) = at(e, "valueFrom.fieldRef.fieldPath") {
                EnvSource::Field(f.as_str().expect("field path").into())
            } else if let Some(r) = at(e, "valueFrom.secretKeyRef") {
                EnvSource::Secret {
                    name: s(r, "name").into(),
                    key: s(r, "key").into(),
                }
            } else {
                panic!("{}: unsupported env source {e:?}", self.overlay)
            };
            env.insert(s(e, "name").into(), src);
        }
        env
    }

    /// A Secret's value (base64 in the rendered manifests).
    fn secret(&self, n: &str, key: &str) -> Option<String> {
        let secret = self.find("Secret", n)?;
        let data = s(secret, &format!("data.{key}"));
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .expect("base64");
        Some(String::from_utf8(bytes).expect("utf8 secret"))
    }
}

fn containers(pod: &Value) -> impl Iterator<Item = &Value> {
    seq(pod, "initContainers")
        .iter()
        .chain(seq(pod, "containers"))
}

/// `host:port` from `http://host:port` or `host:port`.
fn host_port(addr: &str) -> (String, u16) {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.trim_end_matches('/');
    let (h, p) = rest.rsplit_once(':').expect("host:port");
    (h.to_string(), p.parse().expect("port"))
}

fn is_tandem(c: &Value) -> bool {
    seq(c, "command").first().and_then(Value::as_str) == Some("tandem")
}

fn arg_strings(c: &Value) -> Vec<String> {
    seq(c, "args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect()
}

/// The command line `tandem` sees in container `c` when its environment
/// holds `env`: the manifest's arguments, then each variable as the flag
/// whose `env` it is (unless the arguments give that flag: they win, as in
/// clap). Panics if a variable is no flag's `env` for this subcommand.
fn effective_argv(args: &[String], env: &BTreeMap<String, String>) -> Vec<String> {
    let cmd = Cli::command();
    let mut sub = cmd
        .find_subcommand(args.first().expect("a subcommand"))
        .unwrap_or_else(|| panic!("tandem has no subcommand {:?}", args[0]));
    // `tandem planner run`: the flags are the innermost subcommand's.
    for a in &args[1..] {
        match sub.find_subcommand(a) {
            Some(inner) => sub = inner,
            None => break,
        }
    }
    let mut argv = vec!["tandem".to_string()];
    argv.extend(args.iter().cloned());
    for (var, value) in env {
        // Secrets are read from the environment directly: no flag may
        // carry them (a command line is readable by every local user).
        if SECRET_ENV.contains(&var.as_str()) {
            continue;
        }
        let arg = sub
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|e| e == var.as_str()))
            .unwrap_or_else(|| {
                panic!(
                    "tandem {} reads no environment variable {var}",
                    sub.get_name()
                )
            });
        let long = arg.get_long().expect("env flags have long names");
        let given = args
            .iter()
            .any(|a| a == &format!("--{long}") || a.starts_with(&format!("--{long}=")));
        if !given {
            argv.push(format!("--{long}={value}"));
        }
    }
    argv
}

/// Parses `argv` with the binary's definitions: the typed parse must
/// succeed, and the matches of the subcommand come back for reading values.
fn parse(argv: &[String]) -> (String, clap::ArgMatches) {
    if let Err(e) = Cli::try_parse_from(argv) {
        panic!("tandem refuses {argv:?}:\n{e}");
    }
    let m = Cli::command().try_get_matches_from(argv).expect("matches");
    let (sub, sm) = m.subcommand().expect("a subcommand");
    (sub.to_string(), sm.clone())
}

/// The ports a container declares, by name and number.
fn container_ports(c: &Value) -> Vec<(Option<String>, u16)> {
    seq(c, "ports")
        .iter()
        .map(|p| {
            (
                at(p, "name").and_then(Value::as_str).map(str::to_string),
                u16::try_from(
                    at(p, "containerPort")
                        .and_then(Value::as_u64)
                        .expect("port"),
                )
                .expect("port range"),
            )
        })
        .collect()
}

/// A Service/probe port reference (name or number) to a port number.
fn resolve_port(c: &Value, port: &Value) -> Option<u16> {
    let ports = container_ports(c);
    match port {
        Value::Number(n) => {
            let n = u16::try_from(n.as_u64()?).ok()?;
            ports.iter().any(|(_, p)| *p == n).then_some(n)
        }
        Value::String(s) => ports
            .iter()
            .find(|(n, _)| n.as_deref() == Some(s.as_str()))
            .map(|(_, p)| *p),
        _ => None,
    }
}

/// Placeholder values for the downward API and Secrets in the static checks.
fn placeholder_env(m: &Manifests, env: &BTreeMap<String, EnvSource>) -> BTreeMap<String, String> {
    env.iter()
        .map(|(k, src)| {
            let v = match src {
                EnvSource::Literal(v) => v.clone(),
                EnvSource::Field(f) => match f.as_str() {
                    "metadata.name" => "pod-0".into(),
                    "metadata.namespace" => "tandem".into(),
                    "status.podIP" => "10.1.2.3".into(),
                    other => panic!("{}: unexpected field {other}", m.overlay),
                },
                EnvSource::Secret { name, key } => m.secret(name, key).unwrap_or_else(|| {
                    assert_eq!(
                        name, OPERATOR_SECRET,
                        "{}: Secret {name} is neither rendered nor the operator's",
                        m.overlay
                    );
                    "operator-secret".into()
                }),
            };
            (k.clone(), v)
        })
        .collect()
}

/// The addresses a parsed tandem command listens on: (flag, port).
fn listen_ports(sub: &str, m: &clap::ArgMatches) -> Vec<(&'static str, u16)> {
    let mut out = Vec::new();
    if let Ok(Some(a)) = m.try_get_one::<SocketAddr>("addr") {
        out.push(("--addr", a.port()));
    }
    if let Ok(Some(a)) = m.try_get_one::<SocketAddr>("metrics_addr") {
        out.push(("--metrics-addr", a.port()));
    }
    if sub == "decode-worker" {
        let t = m.get_one::<String>("transfer_addr").expect("transfer addr");
        out.push(("--transfer-addr", host_port(t).1));
    }
    if sub == "router" {
        if let Some(h) = m.get_one::<SocketAddr>("http_addr") {
            out.push(("--http-addr", h.port()));
        }
    }
    out
}

fn name_of(v: &Value) -> String {
    s(v, "name").to_string()
}

mod cross_references;
mod local_processes;
mod planner;
