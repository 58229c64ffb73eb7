//! The router's LoRA admin: loading and unloading an adapter on every
//! worker of the cluster at once.
//!
//! `load_adapter` calls each admitted worker's `Worker/LoadAdapter` side by
//! side (each call bounded by [`ADAPTER_CALL_TIMEOUT`]) and records every
//! success in the worker's membership record at once, so the next request
//! naming the adapter is routed without waiting for a load report. The
//! path is the worker's: in a local cluster every worker reads the same
//! directory; on Kubernetes, a volume every pod mounts.

use std::sync::Arc;
use std::time::Duration;

use tandem_proto::worker::v1 as wv1;
use tandem_proto::worker::v1::worker_client::WorkerClient;

use crate::pool::{Cluster, Worker};

/// The most one worker may take to load or unload an adapter.
pub const ADAPTER_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an adapter admin call failed: every worker's refusal, by address.
#[derive(Debug, thiserror::Error)]
pub enum AdapterAdminError {
    /// No worker was there to ask.
    #[error("no worker is admitted to the cluster")]
    NoWorkers,
    /// The workers that refused, and why. A worker refusing with
    /// INVALID_ARGUMENT (a bad adapter, an unknown name) is the caller's
    /// error; anything else is the cluster's.
    #[error("{}", describe(.0))]
    Refused(Vec<(String, tonic::Status)>),
}

impl AdapterAdminError {
    /// Whether the caller asked for something wrong (every refusal an
    /// INVALID_ARGUMENT) rather than the cluster failing.
    pub fn is_callers(&self) -> bool {
        match self {
            Self::NoWorkers => false,
            Self::Refused(r) => r
                .iter()
                .all(|(_, s)| s.code() == tonic::Code::InvalidArgument),
        }
    }
}

fn describe(refusals: &[(String, tonic::Status)]) -> String {
    let each: Vec<String> = refusals
        .iter()
        .map(|(addr, s)| format!("worker {addr}: {}", s.message()))
        .collect();
    each.join("; ")
}

fn admitted(cluster: &Cluster) -> Vec<Arc<Worker>> {
    let present = cluster.present();
    present
        .into_iter()
        .filter(|w| w.info.lock().map(|i| i.is_some()).unwrap_or(false))
        .collect()
}

fn call<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(ADAPTER_CALL_TIMEOUT);
    r
}

/// Loads adapter `name` from `path` on every admitted worker.
pub async fn load_adapter(
    cluster: &Cluster,
    name: &str,
    path: &str,
) -> Result<(), AdapterAdminError> {
    let workers = admitted(cluster);
    if workers.is_empty() {
        return Err(AdapterAdminError::NoWorkers);
    }
    let calls = workers.iter().map(|w| {
        let mut client = WorkerClient::new(w.channel.clone());
        let req = wv1::LoadAdapterRequest {
            name: name.to_string(),
            path: path.to_string(),
        };
        async move { client.load_adapter(call(req)).await }
    });
    let results = futures_util::future::join_all(calls).await;
    let mut refused = Vec::new();
    for (w, result) in workers.iter().zip(results) {
        match result {
            Ok(r) => w.note_adapter(r.into_inner()),
            Err(s) => refused.push((w.addr.clone(), s)),
        }
    }
    match refused.is_empty() {
        true => Ok(()),
        false => Err(AdapterAdminError::Refused(refused)),
    }
}

/// Unloads adapter `name` from every admitted worker that serves it.
pub async fn unload_adapter(cluster: &Cluster, name: &str) -> Result<(), AdapterAdminError> {
    let workers: Vec<Arc<Worker>> = admitted(cluster)
        .into_iter()
        .filter(|w| w.adapter_root(name).is_some())
        .collect();
    if workers.is_empty() {
        let s = tonic::Status::invalid_argument(format!("no worker serves adapter `{name}`"));
        return Err(AdapterAdminError::Refused(vec![("*".into(), s)]));
    }
    let calls = workers.iter().map(|w| {
        let mut client = WorkerClient::new(w.channel.clone());
        let req = wv1::UnloadAdapterRequest {
            name: name.to_string(),
        };
        async move { client.unload_adapter(call(req)).await }
    });
    let results = futures_util::future::join_all(calls).await;
    let mut refused = Vec::new();
    for (w, result) in workers.iter().zip(results) {
        match result {
            Ok(_) => w.forget_adapter(name),
            Err(s) => refused.push((w.addr.clone(), s)),
        }
    }
    match refused.is_empty() {
        true => Ok(()),
        false => Err(AdapterAdminError::Refused(refused)),
    }
}
