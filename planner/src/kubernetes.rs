//! The Kubernetes actuator: reads and patches the `scale` subresource of the
//! prefill and decode Deployments (`PATCH
//! /apis/apps/v1/namespaces/NS/deployments/NAME/scale`, a JSON merge patch
//! that is a whole `autoscaling/v1` `Scale`, what `kubectl scale` sends).
//! The RBAC it needs (`get`, `patch` on `deployments/scale`) is in
//! `deploy/overlays/cpu-planner/planner-rbac.yaml`.
//!
//! Pods cannot move between Deployments, so this actuator does not switch
//! roles: a wrong mix is fixed by scaling one pool down and the other up.
//! Scaling down deletes a pod, whose SIGTERM drains it (it leaves etcd, a
//! decode worker hands its requests over) within the pod's grace period.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tandem_discovery::Role;

use crate::actuator::{Actuator, ActuatorError};
use crate::http::{read_trimmed, HttpClient, HttpError, Request};
use crate::sizing::Sizes;

/// Where a pod finds its service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The content type of the scale patch.
pub const MERGE_PATCH: &str = "application/merge-patch+json";
/// Every API call's deadline.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// Which Deployments hold the pools, and where the API is.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesConfig {
    /// `https://HOST:PORT` (in a pod: the `KUBERNETES_SERVICE_*`
    /// variables), or `http://127.0.0.1:8001` through `kubectl proxy`.
    pub api: String,
    pub namespace: String,
    pub prefill_deployment: String,
    pub decode_deployment: String,
}

/// Scales the pools' Deployments.
#[derive(Debug)]
pub struct Kubernetes {
    config: KubernetesConfig,
    client: HttpClient,
}

impl Kubernetes {
    pub fn new(config: KubernetesConfig, client: HttpClient) -> Self {
        Self { config, client }
    }

    /// In a pod: the API from the environment, the service account's CA,
    /// token and (unless given) namespace.
    pub fn in_cluster(
        namespace: Option<String>,
        prefill_deployment: String,
        decode_deployment: String,
    ) -> Result<Self, HttpError> {
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
            HttpError::Url("KUBERNETES_SERVICE_HOST is not set (not in a pod?)".into())
        })?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        // An IPv6 service address needs brackets in a URL.
        let host = match host.contains(':') {
            true => format!("[{host}]"),
            false => host,
        };
        let namespace = match namespace {
            Some(n) => n,
            None => read_trimmed(&dir.join("namespace"))?,
        };
        let client = HttpClient::plain(API_TIMEOUT)
            .with_ca(&dir.join("ca.crt"))?
            .with_bearer(read_trimmed(&dir.join("token"))?);
        Ok(Self::new(
            KubernetesConfig {
                api: format!("https://{host}:{port}"),
                namespace,
                prefill_deployment,
                decode_deployment,
            },
            client,
        ))
    }

    fn deployment(&self, role: Role) -> &str {
        match role {
            Role::Prefill => &self.config.prefill_deployment,
            Role::Decode => &self.config.decode_deployment,
        }
    }

    /// The URL of `role`'s Deployment's scale subresource.
    pub fn scale_url(&self, role: Role) -> String {
        format!(
            "{}/apis/apps/v1/namespaces/{}/deployments/{}/scale",
            self.config.api.trim_end_matches('/'),
            self.config.namespace,
            self.deployment(role)
        )
    }

    /// The patch that sets `role`'s replicas: a whole `Scale` object.
    pub fn scale_body(&self, role: Role, replicas: usize) -> Value {
        json!({
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": self.deployment(role), "namespace": self.config.namespace},
            "spec": {"replicas": replicas},
        })
    }

    async fn call(&self, request: Request<'_>, what: String) -> Result<Value, ActuatorError> {
        let response = self
            .client
            .send(request)
            .await
            .map_err(|source| ActuatorError::Http {
                what: what.clone(),
                source,
            })?;
        if !(200..300).contains(&response.status) {
            return Err(ActuatorError::Api {
                what,
                status: response.status,
                body: response.text().chars().take(500).collect(),
            });
        }
        serde_json::from_slice(&response.body)
            .map_err(|e| ActuatorError::Failed(format!("{what}: the answer is not JSON: {e}")))
    }

    async fn replicas(&self, role: Role) -> Result<usize, ActuatorError> {
        let url = self.scale_url(role);
        let what = format!("GET {url}");
        let scale = self
            .call(
                Request {
                    method: hyper::Method::GET,
                    url: &url,
                    body: None,
                },
                what.clone(),
            )
            .await?;
        // `spec.replicas` is what the pool is being moved to; a Deployment
        // scaled to zero omits it.
        Ok(scale["spec"]["replicas"].as_u64().unwrap_or(0) as usize)
    }
}

#[async_trait]
impl Actuator for Kubernetes {
    async fn sizes(&self) -> Result<Sizes, ActuatorError> {
        Ok(Sizes {
            prefill: self.replicas(Role::Prefill).await?,
            decode: self.replicas(Role::Decode).await?,
        })
    }

    async fn scale(&self, role: Role, workers: usize) -> Result<(), ActuatorError> {
        let url = self.scale_url(role);
        let body = serde_json::to_vec(&self.scale_body(role, workers))
            .map_err(|e| ActuatorError::Failed(e.to_string()))?;
        let what = format!("PATCH {url}");
        self.call(
            Request {
                method: hyper::Method::PATCH,
                url: &url,
                body: Some((MERGE_PATCH, body)),
            },
            what,
        )
        .await?;
        tracing::info!(pool = %role, workers, deployment = self.deployment(role), "scaled");
        Ok(())
    }

    async fn switch(&self, _to: Role) -> Result<(), ActuatorError> {
        Err(ActuatorError::Unsupported(
            "switching roles (pods cannot move between Deployments)",
        ))
    }

    fn can_switch(&self) -> bool {
        false
    }
}
