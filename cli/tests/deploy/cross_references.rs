//! Every overlay's manifests checked against each other and against the
//! binary's own argument definitions.

use super::*;

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
        if containers(w.pod).any(planner::is_planner) {
            planner::check(&m, o, w);
        } else {
            assert_eq!(
                at(w.pod, "automountServiceAccountToken").and_then(Value::as_bool),
                Some(false),
                "{o}: {} mounts an API token",
                w.name
            );
        }
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
    let planned = planner::planned(&m);
    for pool in ["prefill-worker", "decode-worker"] {
        assert!(
            scaled.contains(pool) != planned.contains(pool),
            "{o}: {pool} needs one owner of its replicas, an HPA or the planner: \
             HPAs {scaled:?}, planner {planned:?}"
        );
    }

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
            if sub == "planner" {
                continue;
            }
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

#[test]
fn cpu_overlay_cross_references_hold() {
    check_overlay("cpu");
}

#[test]
fn cpu_planner_overlay_cross_references_hold() {
    check_overlay("cpu-planner");
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
