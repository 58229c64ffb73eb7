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
const OVERLAYS: &[&str] = &["cpu", "gpu", "gpu-pipeline"];

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
    let sub = cmd
        .find_subcommand(args.first().expect("a subcommand"))
        .unwrap_or_else(|| panic!("tandem has no subcommand {:?}", args[0]));
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

fn check_overlay(overlay: &str) {
    let m = Manifests::load(overlay);
    let o = overlay;
    let workloads = m.workloads();
    assert!(!workloads.is_empty());
    for c in ["router", "prefill-worker", "decode-worker", "etcd"] {
        assert!(
            workloads.iter().any(|w| w.name == c),
            "{o}: no {c} workload"
        );
    }

    // Controllers: selectors match their own pods and no other workload's.
    for w in &workloads {
        let sel = labels(at(w.obj, "spec.selector.matchLabels"));
        assert!(
            selects(&sel, &w.labels),
            "{o}: {} selects not its pods",
            w.name
        );
        let also: Vec<_> = m
            .selected(&sel)
            .into_iter()
            .filter(|x| x.name != w.name)
            .map(|x| x.name)
            .collect();
        assert!(
            also.is_empty(),
            "{o}: {}'s selector also takes {also:?}",
            w.name
        );
        if w.kind == "StatefulSet" {
            let svc = s(w.obj, "spec.serviceName");
            let svc = m
                .find("Service", svc)
                .unwrap_or_else(|| panic!("{o}: {}'s Service {svc} missing", w.name));
            assert_eq!(
                at(svc, "spec.clusterIP").and_then(Value::as_str),
                Some("None"),
                "{o}: a StatefulSet's Service is headless"
            );
        }
        // The pod's account exists and carries no API token.
        let sa = s(w.pod, "serviceAccountName");
        assert!(
            m.find("ServiceAccount", sa).is_some(),
            "{o}: no ServiceAccount {sa}"
        );
        assert_eq!(
            at(w.pod, "automountServiceAccountToken").and_then(Value::as_bool),
            Some(false),
            "{o}: {} mounts an API token",
            w.name
        );
        // Volumes and mounts.
        let volumes: BTreeMap<String, &Value> = seq(w.pod, "volumes")
            .iter()
            .map(|v| (name_of(v), v))
            .collect();
        let templates: BTreeSet<String> = seq(w.obj, "spec.volumeClaimTemplates")
            .iter()
            .map(name)
            .collect();
        for v in volumes.values() {
            if let Some(claim) = at(v, "persistentVolumeClaim.claimName") {
                let claim = claim.as_str().expect("claim");
                assert!(
                    m.find("PersistentVolumeClaim", claim).is_some(),
                    "{o}: no PVC {claim}"
                );
            }
        }
        // A preStop hook runs inside the grace period: leave time for the
        // drain after it.
        let grace = at(w.pod, "terminationGracePeriodSeconds")
            .and_then(Value::as_u64)
            .unwrap_or(30);
        for c in seq(w.pod, "containers") {
            if let Some(sleep) = at(c, "lifecycle.preStop.sleep.seconds").and_then(Value::as_u64) {
                assert!(
                    grace >= sleep + 30,
                    "{o}: {} sleeps {sleep} s in preStop of a {grace} s grace period",
                    w.name
                );
            }
        }
        for c in containers(w.pod) {
            for mount in seq(c, "volumeMounts") {
                let v = s(mount, "name");
                assert!(
                    volumes.contains_key(v) || templates.contains(v),
                    "{o}: {} mounts unknown volume {v}",
                    w.name
                );
            }
            // Requests and limits on every container.
            for r in [
                "requests.cpu",
                "requests.memory",
                "limits.cpu",
                "limits.memory",
            ] {
                assert!(
                    at(c, &format!("resources.{r}")).is_some(),
                    "{o}: {} container {} has no {r}",
                    w.name,
                    name_of(c)
                );
            }
        }
    }

    // Services: select pods, and target ports those pods declare.
    for svc in m.of_kind("Service") {
        let sel = labels(at(svc, "spec.selector"));
        let targets = m.selected(&sel);
        assert!(
            !targets.is_empty(),
            "{o}: Service {} selects no pods",
            name(svc)
        );
        for p in seq(svc, "spec.ports") {
            let target = at(p, "targetPort").or_else(|| at(p, "port")).expect("port");
            for w in &targets {
                assert!(
                    seq(w.pod, "containers")
                        .iter()
                        .any(|c| resolve_port(c, target).is_some()),
                    "{o}: Service {} targets port {target:?} that {} does not declare",
                    name(svc),
                    w.name
                );
            }
        }
    }

    // PDBs select pods; HPAs scale workloads whose replicas they own.
    for pdb in m.of_kind("PodDisruptionBudget") {
        let sel = labels(at(pdb, "spec.selector.matchLabels"));
        assert!(
            !m.selected(&sel).is_empty(),
            "{o}: PDB {} selects nothing",
            name(pdb)
        );
    }
    let mut scaled = BTreeSet::new();
    for hpa in m.of_kind("HorizontalPodAutoscaler") {
        let t = s(hpa, "spec.scaleTargetRef.name");
        let target = m
            .find(s(hpa, "spec.scaleTargetRef.kind"), t)
            .unwrap_or_else(|| panic!("{o}: HPA {} targets missing {t}", name(hpa)));
        assert!(
            at(target, "spec.replicas").is_none(),
            "{o}: {t} sets replicas, which the HPA owns (every apply would reset them)"
        );
        scaled.insert(t.to_string());
    }
    assert!(
        scaled.contains("prefill-worker") && scaled.contains("decode-worker"),
        "{o}: each pool needs its own HPA: {scaled:?}"
    );

    // Every tandem container: arguments and environment accepted by the
    // binary; probes and declared ports where the binary listens.
    let mut etcd_urls = Vec::new();
    let mut kv_ports = Vec::new();
    for w in &workloads {
        for c in containers(w.pod) {
            if !is_tandem(c) {
                continue;
            }
            let env = placeholder_env(&m, &m.env(c));
            let argv = effective_argv(&arg_strings(c), &env);
            let (sub, matches) = parse(&argv);
            if let Ok(Some(e)) = matches.try_get_many::<String>("etcd") {
                etcd_urls.extend(e.cloned());
            }
            if let Ok(Some(model)) = matches.try_get_one::<PathBuf>("model") {
                assert!(
                    seq(c, "volumeMounts")
                        .iter()
                        .any(|mnt| model.starts_with(s(mnt, "mountPath"))),
                    "{o}: {} reads {} outside its volumes",
                    w.name,
                    model.display()
                );
            }
            if sub == "gen-model" {
                continue;
            }
            let ports = listen_ports(&sub, &matches);
            for (flag, port) in &ports {
                assert!(
                    container_ports(c).iter().any(|(_, p)| p == port),
                    "{o}: {} listens on {port} ({flag}) but does not declare it",
                    w.name
                );
            }
            let grpc = ports
                .iter()
                .find(|(f, _)| *f == "--addr")
                .map(|(_, p)| *p)
                .expect("a gRPC address");
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                let p = at(c, probe).unwrap_or_else(|| panic!("{o}: {} has no {probe}", w.name));
                let port = at(p, "grpc.port")
                    .and_then(Value::as_u64)
                    .unwrap_or_else(|| panic!("{o}: {}'s {probe} is not gRPC health", w.name));
                assert_eq!(port, u64::from(grpc), "{o}: {}'s {probe} port", w.name);
            }
            if sub != "router" {
                // Workers must advertise a reachable host when bound to all
                // interfaces.
                let bound: SocketAddr = matches
                    .get_one::<SocketAddr>("addr")
                    .copied()
                    .expect("addr");
                if bound.ip().is_unspecified() {
                    assert!(
                        matches.get_one::<String>("advertise_host").is_some(),
                        "{o}: {} binds {bound} but advertises no host",
                        w.name
                    );
                    assert!(
                        matches.get_one::<String>("id").is_some(),
                        "{o}: {} replicas need unique ids (the pod name)",
                        w.name
                    );
                }
            }
            if sub == "decode-worker" {
                let t = matches
                    .get_one::<String>("transfer_addr")
                    .expect("transfer");
                kv_ports.push((w.labels.clone(), host_port(t).1));
            }
            if sub == "router" {
                // The router Service exposes the gRPC and HTTP ports.
                let svc = m.find("Service", "router").expect("router Service");
                for (_, port) in &ports {
                    assert!(
                        seq(svc, "spec.ports")
                            .iter()
                            .any(|p| resolve_port(c, at(p, "targetPort").expect("target"))
                                == Some(*port)),
                        "{o}: the router Service does not expose port {port}"
                    );
                }
            }
        }
    }

    // The etcd address names the etcd client Service, on its client port,
    // which reaches etcd's --listen-client-urls.
    assert!(!etcd_urls.is_empty(), "{o}: no etcd address given");
    let etcd = m.workload("etcd");
    let etcd_c = &seq(etcd.pod, "containers")[0];
    let listen = arg_strings(etcd_c)
        .iter()
        .find_map(|a| a.strip_prefix("--listen-client-urls=").map(str::to_string))
        .expect("etcd listens for clients");
    let (_, etcd_port) = host_port(&listen);
    for url in &etcd_urls {
        let (host, port) = host_port(url);
        let svc = m
            .find("Service", &host)
            .unwrap_or_else(|| panic!("{o}: etcd address {url} names no Service"));
        assert!(
            m.selected(&labels(at(svc, "spec.selector")))
                .iter()
                .all(|w| w.name == "etcd"),
            "{o}: Service {host} is not etcd's"
        );
        let p = seq(svc, "spec.ports")
            .iter()
            .find(|p| at(p, "port").and_then(Value::as_u64) == Some(u64::from(port)))
            .unwrap_or_else(|| panic!("{o}: Service {host} has no port {port}"));
        assert_eq!(
            resolve_port(etcd_c, at(p, "targetPort").expect("target")),
            Some(etcd_port),
            "{o}: {url} does not reach etcd's client port"
        );
    }

    // NetworkPolicies: select pods, allow ports those pods declare; the KV
    // transfer port only from prefill workers.
    for np in m.of_kind("NetworkPolicy") {
        let sel = labels(at(np, "spec.podSelector.matchLabels"));
        let targets = m.selected(&sel);
        assert!(
            !targets.is_empty(),
            "{o}: NetworkPolicy {} selects nothing",
            name(np)
        );
        for rule in seq(np, "spec.ingress") {
            let peers: Vec<Vec<Workload>> = seq(rule, "from")
                .iter()
                .map(|f| {
                    let ps = labels(at(f, "podSelector.matchLabels"));
                    let peers = m.selected(&ps);
                    assert!(
                        !peers.is_empty(),
                        "{o}: {} allows a peer that matches no pod",
                        name(np)
                    );
                    peers
                })
                .collect();
            for p in seq(rule, "ports") {
                let port = at(p, "port").expect("port");
                for w in &targets {
                    assert!(
                        seq(w.pod, "containers")
                            .iter()
                            .any(|c| resolve_port(c, port).is_some()),
                        "{o}: NetworkPolicy {} opens {port:?} that {} does not declare",
                        name(np),
                        w.name
                    );
                }
                for (decode_labels, kv) in &kv_ports {
                    let opens_kv =
                        port.as_u64() == Some(u64::from(*kv)) && selects(&sel, decode_labels);
                    if opens_kv {
                        assert!(!peers.is_empty(), "{o}: the KV port is open to everyone");
                        for w in peers.iter().flatten() {
                            assert_eq!(
                                w.labels.get("tandem/role").map(String::as_str),
                                Some("prefill"),
                                "{o}: the KV port is open to {}",
                                w.name
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(!kv_ports.is_empty());
    for (decode_labels, _) in &kv_ports {
        assert!(
            m.of_kind("NetworkPolicy").any(|np| selects(
                &labels(at(np, "spec.podSelector.matchLabels")),
                decode_labels
            )),
            "{o}: a decode worker without a NetworkPolicy"
        );
    }

    if overlay.starts_with("gpu") {
        for w in workloads
            .iter()
            .filter(|w| w.labels.contains_key("tandem/role"))
        {
            for c in seq(w.pod, "containers") {
                assert!(
                    at(c, "resources.limits")
                        .and_then(|l| l.get("nvidia.com/gpu"))
                        .is_some(),
                    "{o}: {} has no GPUs",
                    w.name
                );
            }
        }
    }
}

fn name_of(v: &Value) -> String {
    s(v, "name").to_string()
}

#[test]
fn cpu_overlay_cross_references_hold() {
    check_overlay("cpu");
}

#[test]
fn gpu_overlay_cross_references_hold() {
    check_overlay("gpu");
}

#[test]
fn gpu_pipeline_overlay_cross_references_hold() {
    check_overlay("gpu-pipeline");
}

#[test]
fn every_overlay_is_checked() {
    let on_disk: BTreeSet<String> = std::fs::read_dir(repo().join("deploy/overlays"))
        .expect("deploy/overlays")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    let checked: BTreeSet<String> = OVERLAYS.iter().map(|s| (*s).to_string()).collect();
    assert_eq!(on_disk, checked, "add new overlays to OVERLAYS and a test");
}

// ---- the cpu overlay as local processes ----

/// One pod of a workload run as local processes: its ports moved to free
/// loopback ports, its volumes to directories.
struct LocalPod {
    ports: HashMap<u16, u16>,
    volumes: Vec<(String, PathBuf)>,
    /// Each container's environment, resolved.
    env: HashMap<String, BTreeMap<String, String>>,
}

impl LocalPod {
    /// `0.0.0.0:P` → `127.0.0.1:P'` and `/models/...` → `<dir>/...`.
    fn rewrite(&self, arg: &str) -> String {
        let mut out = arg.to_string();
        if let Some(i) = out.find("0.0.0.0:") {
            let port: u16 = out[i + 8..].parse().expect("a port after 0.0.0.0:");
            out = format!("{}127.0.0.1:{}", &out[..i], self.ports[&port]);
        }
        for (mount, dir) in &self.volumes {
            if let Some(i) = out.find(mount.as_str()) {
                out = format!("{}{}{}", &out[..i], dir.display(), &out[i + mount.len()..]);
            }
        }
        out
    }

    fn command(&self, tandem: &Path, c: &Value) -> Command {
        let mut cmd = Command::new(tandem);
        cmd.args(arg_strings(c).iter().map(|a| self.rewrite(a)))
            .env_clear()
            .envs(&self.env[&name_of(c)])
            .stdin(Stdio::null());
        cmd
    }
}

fn local_pod(m: &Manifests, w: &Workload, root: &Path, etcd: &str) -> LocalPod {
    let main = &seq(w.pod, "containers")[0];
    let ports = container_ports(main)
        .into_iter()
        .map(|(_, p)| (p, free_port()))
        .collect();
    let volumes = seq(main, "volumeMounts")
        .iter()
        .map(|mnt| {
            let dir = root.join(&w.name).join(s(mnt, "name"));
            std::fs::create_dir_all(&dir).expect("volume dir");
            (s(mnt, "mountPath").to_string(), dir)
        })
        .collect();
    let resolve = |c: &Value| -> BTreeMap<String, String> {
        m.env(c)
            .into_iter()
            .map(|(k, src)| {
                let v = match src {
                    EnvSource::Literal(v) if k == "TANDEM_ETCD" => {
                        // The etcd Service's address → the test's etcd.
                        assert!(v.contains("etcd"), "{v}");
                        etcd.to_string()
                    }
                    EnvSource::Literal(v) => v,
                    EnvSource::Field(f) => match f.as_str() {
                        "metadata.name" => format!("{}-0", w.name),
                        "status.podIP" => "127.0.0.1".into(),
                        other => panic!("unexpected field {other}"),
                    },
                    EnvSource::Secret { name, key } => {
                        m.secret(&name, &key).expect("cpu renders its Secret")
                    }
                };
                (k, v)
            })
            .collect()
    };
    let env = containers(w.pod)
        .map(|c| (name_of(c), resolve(c)))
        .collect();
    LocalPod {
        ports,
        volumes,
        env,
    }
}

/// Runs a pod's init containers, then starts its main container and waits
/// for `listening on`.
fn start_pod(tandem: &Path, w: &Workload, pod: &LocalPod) -> KillOnDrop {
    for c in seq(w.pod, "initContainers") {
        assert!(is_tandem(c), "{}: init container is not tandem", w.name);
        let status = pod
            .command(tandem, c)
            .stdout(Stdio::null())
            .status()
            .expect("init container runs");
        assert!(
            status.success(),
            "{}: init container {} failed",
            w.name,
            name_of(c)
        );
    }
    let main = &seq(w.pod, "containers")[0];
    let mut command = pod.command(tandem, main);
    if w.name == "router" {
        // The test checks which workers served its call.
        command.arg("--debug-routing-headers");
    }
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tandem starts");
    let stdout = child.stdout.take().expect("stdout");
    let process = KillOnDrop(child);
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("{} exited before listening", w.name))
            .expect("a line");
        if line.starts_with("listening on ") {
            std::thread::spawn(move || for _ in lines {});
            return process;
        }
    }
}

/// Each of the container's gRPC probes, as the kubelet would send it.
async fn probe(w: &Workload<'_>, pod: &LocalPod) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let main = &seq(w.pod, "containers")[0];
    for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let p = at(main, kind).expect("probe");
        let port =
            u16::try_from(at(p, "grpc.port").and_then(Value::as_u64).expect("grpc")).expect("port");
        let service = at(p, "grpc.service").and_then(Value::as_str).unwrap_or("");
        let channel = tonic::transport::Channel::from_shared(format!(
            "http://127.0.0.1:{}",
            pod.ports[&port]
        ))
        .expect("url")
        .connect()
        .await
        .expect("health connects");
        let mut c = HealthClient::new(channel);
        let r = c
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("{} {kind} ({service:?}): {e}", w.name))
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{} {kind}", w.name);
    }
}

/// Expands `$(VAR)` as the kubelet does in a container's arguments.
fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    env.iter().fold(arg.to_string(), |a, (k, v)| {
        a.replace(&format!("$({k})"), v)
    })
}

/// GET `path` on a local port until etcd says it is healthy (at most 20 s).
fn wait_etcd_healthy(port: u16, path: &str) {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let mut body = String::new();
        if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = write!(c, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
            let _ = c.read_to_string(&mut body);
        }
        if body.contains(r#""health":"true""#) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "etcd on port {port} not healthy: {body}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The etcd StatefulSet's members as local `etcd` processes with the
/// manifest's arguments: `$(POD_NAME)`, `$(POD_NAMESPACE)` expanded, member
/// DNS names and listen addresses moved to loopback ports, the data volume
/// to a directory. Returns them and their client URLs.
fn start_etcd(m: &Manifests, root: &Path) -> (Vec<KillOnDrop>, Vec<String>) {
    let w = m.workload("etcd");
    let replicas = at(w.obj, "spec.replicas")
        .and_then(Value::as_u64)
        .expect("replicas");
    let c = &seq(w.pod, "containers")[0];
    let service = s(w.obj, "spec.serviceName");
    let namespace = "tandem";
    let ports: Vec<HashMap<u16, u16>> = (0..replicas)
        .map(|_| {
            container_ports(c)
                .into_iter()
                .map(|(_, p)| (p, free_port()))
                .collect()
        })
        .collect();
    let member = |j: u64| format!("{}-{j}", w.name);
    let mut procs = Vec::new();
    for i in 0..replicas {
        let env: BTreeMap<String, String> = m
            .env(c)
            .into_iter()
            .map(|(k, src)| {
                let v = match src {
                    EnvSource::Field(f) if f == "metadata.name" => member(i),
                    EnvSource::Field(f) if f == "metadata.namespace" => namespace.into(),
                    other => panic!("etcd: unexpected env {k}: {other:?}"),
                };
                (k, v)
            })
            .collect();
        let args: Vec<String> = arg_strings(c)
            .iter()
            .map(|a| {
                let mut a = expand(a, &env);
                for (j, pj) in ports.iter().enumerate() {
                    let host = format!("{}.{service}.{namespace}.svc", member(j as u64));
                    for (port, local) in pj {
                        a = a.replace(&format!("{host}:{port}"), &format!("127.0.0.1:{local}"));
                    }
                }
                for (port, local) in &ports[i as usize] {
                    a = a.replace(&format!("0.0.0.0:{port}"), &format!("127.0.0.1:{local}"));
                }
                for mnt in seq(c, "volumeMounts") {
                    let dir = root.join(member(i)).join(s(mnt, "name"));
                    a = a.replace(s(mnt, "mountPath"), &dir.display().to_string());
                }
                assert!(
                    !a.contains("svc") && !a.contains("$("),
                    "etcd arg left: {a}"
                );
                a
            })
            .collect();
        // The image's /usr/local/bin/etcd is the installed etcd here.
        let child = Command::new("etcd")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts (install etcd-server)");
        procs.push(KillOnDrop(child));
    }
    let clients: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{}", p[&2379]))
        .collect();
    // Ready as the kubelet's readiness probe sees it.
    let probe = at(c, "readinessProbe.httpGet").expect("etcd readiness probe");
    let port = resolve_port(c, at(probe, "port").expect("port")).expect("probe port");
    for p in &ports {
        wait_etcd_healthy(p[&port], s(probe, "path"));
    }
    (procs, clients)
}

#[test]
fn cpu_overlay_runs_as_local_processes_and_serves_a_request() {
    let tandem = Path::new(env!("CARGO_BIN_EXE_tandem"));
    let m = Manifests::load("cpu");
    let root = tempfile::tempdir().expect("tempdir");
    // The etcd client Service balances over the members: give all three.
    let (etcd, etcd_clients) = start_etcd(&m, root.path());
    let mut running = Vec::new();
    let mut pods = HashMap::new();
    // Workers first: the router admits what is registered when it starts.
    for n in ["prefill-worker", "decode-worker", "router"] {
        let w = m.workload(n);
        let pod = local_pod(&m, &w, root.path(), &etcd_clients.join(","));
        running.push(start_pod(tandem, &w, &pod));
        pods.insert(n, pod);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        for n in ["prefill-worker", "decode-worker", "router"] {
            probe(&m.workload(n), &pods[n]).await;
        }
        // Long enough for the router's and the decode worker's default
        // remote-prefill threshold (256): the prompt's KV crosses the
        // transfer port the decode worker advertised.
        let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7 + 3) % 2000).collect();
        let router = format!("127.0.0.1:{}", pods["router"].ports[&50051]);
        let decode = format!("127.0.0.1:{}", pods["decode-worker"].ports[&50051]);
        let prefill = format!("127.0.0.1:{}", pods["prefill-worker"].ports[&50051]);
        let mut client = GenerationClient::connect(format!("http://{router}"))
            .await
            .expect("router connects");
        let resp = client
            .generate(v1::GenerateRequest {
                prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds {
                    ids: prompt,
                })),
                sampling: Some(v1::SamplingParams {
                    temperature: Some(0.0),
                    ..Default::default()
                }),
                max_tokens: Some(8),
                ignore_eos: true,
                ..Default::default()
            })
            .await
            .expect("generate");
        let header = |k: &str| {
            resp.metadata()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        // The router reached both workers at the addresses they advertised
        // in etcd.
        assert_eq!(
            header(ROUTED_DECODE_HEADER).as_deref(),
            Some(decode.as_str())
        );
        assert_eq!(
            header(ROUTED_PREFILL_HEADER).as_deref(),
            Some(prefill.as_str())
        );
        let mut stream = resp.into_inner();
        let (mut tokens, mut finished) = (0, false);
        while let Some(msg) = stream.message().await.expect("stream") {
            match msg.event {
                Some(v1::generate_response::Event::Delta(d)) => tokens += d.token_ids.len(),
                Some(v1::generate_response::Event::Finished(_)) => finished = true,
                Some(v1::generate_response::Event::PromptLogprobs(_)) | None => {}
            }
        }
        assert!(finished);
        assert_eq!(tokens, 8);
        // The prefill worker computed the prompt; the decode worker only
        // its last token and the new ones (no local fallback).
        let (p, d) = (load(&prefill).await, load(&decode).await);
        assert!(
            p.computed_tokens >= 299,
            "prefill computed {}",
            p.computed_tokens
        );
        assert!(
            d.computed_tokens < 32,
            "decode computed {}",
            d.computed_tokens
        );
    });
    drop(running);
    drop(etcd);
}

#[test]
fn workers_advertise_the_pod_ip_with_the_bound_port() {
    use tandem_server::advertised_addr;
    let bound: SocketAddr = "0.0.0.0:50052".parse().expect("addr");
    assert_eq!(advertised_addr(Some("10.1.2.3"), bound), "10.1.2.3:50052");
    assert_eq!(advertised_addr(Some("fd00::7"), bound), "[fd00::7]:50052");
    assert_eq!(advertised_addr(Some("[fd00::7]"), bound), "[fd00::7]:50052");
    assert_eq!(advertised_addr(None, bound), "0.0.0.0:50052");
}
