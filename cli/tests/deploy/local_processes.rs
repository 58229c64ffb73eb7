//! The `cpu` overlay's processes started locally with the manifests'
//! arguments and environment, serving a request.

use super::*;

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

/// GET `path` on a local port until etcd says it is healthy (at most 20 s);
/// an error naming what went wrong when it does not, or when one of
/// `procs` exits first (its log is in `logs`).
fn wait_etcd_healthy(
    port: u16,
    path: &str,
    procs: &mut [KillOnDrop],
    logs: &[PathBuf],
) -> Result<(), String> {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let mut body = String::new();
        if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = write!(c, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
            let _ = c.read_to_string(&mut body);
        }
        if body.contains(r#""health":"true""#) {
            return Ok(());
        }
        for (p, log) in procs.iter_mut().zip(logs) {
            if let Ok(Some(status)) = p.0.try_wait() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: String = text.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(format!("an etcd member exited ({status}): {tail}"));
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(format!("etcd on port {port} not healthy in 20 s: {body}"));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The etcd StatefulSet's members as local `etcd` processes with the
/// manifest's arguments: `$(POD_NAME)`, `$(POD_NAMESPACE)` expanded, member
/// DNS names and listen addresses moved to loopback ports, the data volume
/// to a directory. Returns them and their client URLs. Ports are picked
/// free and then released, so another process may take one before etcd
/// binds it: a member that exits, or a cluster not healthy in time, is
/// started again on fresh ports (three tries).
fn start_etcd(m: &Manifests, root: &Path) -> (Vec<KillOnDrop>, Vec<String>) {
    let mut errors = Vec::new();
    for attempt in 0..3 {
        match try_start_etcd(m, &root.join(format!("etcd-try-{attempt}"))) {
            Ok(started) => return started,
            Err(e) => errors.push(e),
        }
    }
    panic!("etcd never became healthy: {}", errors.join("; "));
}

fn try_start_etcd(m: &Manifests, root: &Path) -> Result<(Vec<KillOnDrop>, Vec<String>), String> {
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
    let mut logs = Vec::new();
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
        std::fs::create_dir_all(root).expect("etcd root");
        let log = root.join(format!("{}.log", member(i)));
        let child = Command::new("etcd")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("etcd log"))
            .spawn()
            .expect("etcd starts (install etcd-server)");
        procs.push(KillOnDrop(child));
        logs.push(log);
    }
    let clients: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{}", p[&2379]))
        .collect();
    // Ready as the kubelet's readiness probe sees it.
    let probe = at(c, "readinessProbe.httpGet").expect("etcd readiness probe");
    let port = resolve_port(c, at(probe, "port").expect("port")).expect("probe port");
    for p in &ports {
        wait_etcd_healthy(p[&port], s(probe, "path"), &mut procs, &logs)?;
    }
    Ok((procs, clients))
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
