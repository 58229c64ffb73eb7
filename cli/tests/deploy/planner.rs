//! The planner's manifests: the one pod with an API token, a Role that
//! allows reading and patching the worker Deployments' scale and nothing
//! else, Deployments whose replicas nobody else owns, and router metrics it
//! can reach.

use super::*;

/// Whether container `c` runs `tandem planner`.
pub(super) fn is_planner(c: &Value) -> bool {
    is_tandem(c) && arg_strings(c).first().map(String::as_str) == Some("planner")
}

/// The value of `--flag=VALUE` in `args`, else `default`.
fn flag<'a>(args: &'a [String], flag: &str, default: &'a str) -> &'a str {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("--{flag}=")))
        .unwrap_or(default)
}

/// The Deployments the overlay's planners scale.
pub(super) fn planned(m: &Manifests) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for w in m.workloads() {
        for c in containers(w.pod).filter(|c| is_planner(c)) {
            let args = arg_strings(c);
            out.insert(flag(&args, "prefill-deployment", "prefill-worker").to_string());
            out.insert(flag(&args, "decode-deployment", "decode-worker").to_string());
        }
    }
    out
}

/// Checks a planner workload `w` of overlay `o`.
pub(super) fn check(m: &Manifests, o: &str, w: &Workload) {
    let sa = s(w.pod, "serviceAccountName");
    assert_ne!(sa, "tandem", "{o}: the planner has an account of its own");
    let scaled = planned(m);
    // Rules of every Role bound to the planner's account.
    let mut rules = Vec::new();
    for rb in m.of_kind("RoleBinding") {
        let bound = seq(rb, "subjects")
            .iter()
            .any(|s_| s(s_, "kind") == "ServiceAccount" && s(s_, "name") == sa);
        if bound {
            assert_eq!(
                s(rb, "roleRef.kind"),
                "Role",
                "{o}: a namespaced Role, not a ClusterRole"
            );
            let role = m
                .find("Role", s(rb, "roleRef.name"))
                .unwrap_or_else(|| panic!("{o}: RoleBinding {} names no Role", name(rb)));
            rules.extend(seq(role, "rules").iter().cloned());
        }
    }
    assert!(!rules.is_empty(), "{o}: the planner's account has no Role");
    let strings = |v: &Value, k: &str| -> BTreeSet<String> {
        seq(v, k)
            .iter()
            .map(|x| x.as_str().expect("string").to_string())
            .collect()
    };
    let mut granted = BTreeSet::new();
    for r in &rules {
        assert_eq!(
            strings(r, "apiGroups"),
            BTreeSet::from(["apps".to_string()]),
            "{o}: {r:?}"
        );
        assert_eq!(
            strings(r, "resources"),
            BTreeSet::from(["deployments/scale".to_string()]),
            "{o}: the planner may touch only the scale subresource"
        );
        let verbs = strings(r, "verbs");
        assert!(
            verbs.iter().all(|v| v == "get" || v == "patch"),
            "{o}: verbs {verbs:?}: get and patch are all the planner sends"
        );
        for d in strings(r, "resourceNames") {
            assert!(
                m.find("Deployment", &d).is_some(),
                "{o}: the Role names a missing Deployment {d}"
            );
            if verbs.contains("get") && verbs.contains("patch") {
                granted.insert(d);
            }
        }
    }
    assert_eq!(
        granted, scaled,
        "{o}: the Role grants exactly the Deployments the planner scales"
    );
    for d in &scaled {
        let dep = m.find("Deployment", d).expect("checked above");
        assert!(
            at(dep, "spec.replicas").is_none(),
            "{o}: {d} sets replicas, which the planner owns"
        );
        assert!(
            !m.of_kind("HorizontalPodAutoscaler")
                .any(|h| s(h, "spec.scaleTargetRef.name") == d),
            "{o}: an HPA and the planner would both own {d}'s replicas"
        );
    }
    // The router metrics it reads: a Service of the routers, on a port that
    // reaches their metrics port.
    for c in containers(w.pod).filter(|c| is_planner(c)) {
        let args = arg_strings(c);
        let url = flag(&args, "router-metrics", "");
        let (host, port) = host_port(url.trim_end_matches("/metrics"));
        let svc = m
            .find("Service", &host)
            .unwrap_or_else(|| panic!("{o}: {url} names no Service"));
        let routers = m.selected(&labels(at(svc, "spec.selector")));
        assert!(
            routers.iter().all(|r| r.name == "router") && !routers.is_empty(),
            "{o}: {host} is not the routers'"
        );
        let p = seq(svc, "spec.ports")
            .iter()
            .find(|p| at(p, "port").and_then(Value::as_u64) == Some(u64::from(port)))
            .unwrap_or_else(|| panic!("{o}: {host} has no port {port}"));
        let router = &seq(routers[0].pod, "containers")[0];
        let metrics = effective_argv(&arg_strings(router), &BTreeMap::new())
            .iter()
            .find_map(|a| a.strip_prefix("--metrics-addr=").map(|m| host_port(m).1))
            .expect("routers serve metrics");
        assert_eq!(
            resolve_port(router, at(p, "targetPort").expect("target")),
            Some(metrics),
            "{o}: {url}"
        );
        if args.iter().any(|a| a == "--scrape-every-address") {
            assert_eq!(
                at(svc, "spec.clusterIP").and_then(Value::as_str),
                Some("None"),
                "{o}: every address of a headless Service"
            );
        }
    }
}
