//! A worker's presence in etcd: [`Registration`].
//!
//! Registering grants a lease, puts the worker's key under it, and spawns a
//! keep-alive task. The key lives exactly as long as the lease, so the three
//! ways a worker leaves are all visible to the router:
//!
//! * drain (SIGTERM): [`Registration::deregister`] revokes the lease and the
//!   key disappears at once;
//! * crash (`kill -9`) or a dropped [`Registration`]: the keep-alive stops,
//!   nothing renews the lease, and etcd deletes the key one TTL later;
//! * partition: renewals fail, the lease expires, the key is deleted.
//!
//! # The keep-alive task
//!
//! It opens etcd's lease keep-alive stream and renews every third of the
//! granted TTL (etcd may grant more than asked: it has a minimum TTL), each
//! renewal bounded by [`crate::etcd::REQUEST_TIMEOUT`]. When the stream
//! breaks it reopens it after a backoff (200 ms doubling to a third of the
//! TTL, so retries never spin and a lease that can still be saved is
//! retried in time). Every retry (a broken stream, a failed re-grant) first
//! replaces the task's etcd client with a fresh one: with etcd user auth,
//! the old client's token dies with an etcd restart or expires, and every
//! call on it would fail with "invalid auth token" forever; a fresh client
//! authenticates again. When etcd answers a renewal with TTL 0 the lease is
//! gone — the worker was partitioned for longer than the TTL — and the task
//! grants a fresh lease and puts the key again, retrying with the same
//! backoff until etcd takes it, so a worker that was cut off reappears on
//! its own. After every renewal the task also reads the key back: one
//! deleted or overwritten behind its back (by hand, by a stray process
//! with the same id) is put again under the current lease, so a live
//! worker never stays invisible to routers for longer than a renewal
//! interval. The current lease id is shared with the [`Registration`] so
//! that `deregister` always revokes the lease the key is under now;
//! `deregister` retries once on a fresh client if etcd refuses the
//! registration's own client's token.
//!
//! The task runs until the [`Registration`] is dropped or deregistered (it
//! is aborted then); it needs a tokio runtime with the time driver.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions};
use tokio::task::JoinHandle;

use crate::etcd::{call, connect, is_stale_token, Backoff, REQUEST_TIMEOUT};
use crate::record::{check_name, worker_key};
use crate::{DiscoveryError, EtcdConfig, WorkerRecord};

/// The lease TTL workers use unless told otherwise.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// A worker's live registration (see the module doc). Drop it to stop
/// renewing (the key expires after the TTL); call
/// [`Registration::deregister`] to remove the key at once.
pub struct Registration {
    config: EtcdConfig,
    key: String,
    client: Client,
    lease: Arc<AtomicI64>,
    ttl: Duration,
    task: JoinHandle<()>,
}

impl Registration {
    /// Publishes `record` at `/tandem/<cluster>/workers/<role>/<id>` under a
    /// lease of `ttl` (rounded up to whole seconds, at least 1 s; etcd may
    /// grant more), and keeps it alive in a background task. Fails when
    /// etcd cannot be reached or refuses the lease or the put; nothing is
    /// left behind then.
    ///
    /// A second registration with the same role and id overwrites the first
    /// one's key: ids must be unique per role within a cluster.
    pub async fn register(
        config: &EtcdConfig,
        cluster: &str,
        record: WorkerRecord,
        ttl: Duration,
    ) -> Result<Registration, DiscoveryError> {
        check_name("cluster name", cluster)?;
        record.check()?;
        let mut client = connect(config).await?;
        let key = worker_key(cluster, record.role, &record.id);
        let value = record.encode();
        let ttl_secs = i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
            .unwrap_or(i64::MAX)
            .max(1);
        let (lease_id, granted) =
            grant_and_put(&mut client, config, &key, &value, ttl_secs, |_| {}).await?;
        let lease = Arc::new(AtomicI64::new(lease_id));
        let keeper = KeepAlive {
            client: client.clone(),
            config: config.clone(),
            key: key.clone(),
            value,
            ttl_secs,
            granted,
            lease: Arc::clone(&lease),
        };
        let task = tokio::spawn(keeper.run());
        tracing::info!(key = %key, lease = lease_id, ttl_s = granted, "registered in etcd");
        Ok(Registration {
            config: config.clone(),
            key,
            client,
            lease,
            ttl: Duration::from_secs(u64::try_from(granted).unwrap_or(1)),
            task,
        })
    }

    /// The etcd key this worker is registered under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease the key is under now (it changes when a lost lease is
    /// replaced).
    pub fn lease_id(&self) -> i64 {
        self.lease.load(Ordering::Acquire)
    }

    /// The TTL etcd granted (at least the one asked for).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How many other workers of this one's role are registered in its
    /// cluster now (a draining decode worker hands its requests over only
    /// when another can take them).
    pub async fn peers(&mut self) -> Result<usize, DiscoveryError> {
        let Some(end) = self.key.rfind('/') else {
            return Ok(0);
        };
        let prefix = self.key[..=end].to_string();
        let options = GetOptions::new().with_prefix().with_keys_only();
        let found = call(
            &self.config,
            "listing the pool's workers",
            self.client.get(prefix, Some(options)),
        )
        .await?;
        Ok(found
            .kvs()
            .iter()
            .filter(|kv| kv.key() != self.key.as_bytes())
            .count())
    }

    /// Stops the keep-alive and revokes the lease, which deletes the key at
    /// once (watchers see `Down` promptly). Use it when draining. If etcd
    /// cannot be reached the error says so; the key then still expires one
    /// TTL later, because nothing renews it any more.
    pub async fn deregister(mut self) -> Result<(), DiscoveryError> {
        self.task.abort();
        // Wait for the abort so the task cannot swap in a new lease after we
        // read the current one. An aborted task's join error is expected.
        let _ = (&mut self.task).await;
        let id = self.lease.load(Ordering::Acquire);
        let what = "revoking the worker's lease";
        let mut result = call(&self.config, what, self.client.lease_revoke(id)).await;
        if matches!(&result, Err(e) if is_stale_token(e)) {
            // etcd forgot this client's token (restarted, or it expired):
            // authenticate again.
            let mut client = connect(&self.config).await?;
            result = call(&self.config, what, client.lease_revoke(id)).await;
        }
        match result {
            Ok(_) => {
                tracing::info!(key = %self.key, lease = id, "deregistered from etcd");
                Ok(())
            }
            // Already expired: the key is gone, which is what was asked.
            Err(DiscoveryError::Request {
                source: etcd_client::Error::GRpcStatus(status),
                ..
            }) if status.code() == tonic::Code::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("endpoints", &self.config.endpoints())
            .field("key", &self.key)
            .field("lease", &self.lease_id())
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Without renewals the lease (and the key) expire after the TTL:
        // exactly what a crashed worker looks like.
        self.task.abort();
    }
}

/// Grants a lease of `ttl_secs` and puts `key` under it. Returns the lease
/// id and the TTL etcd granted. `granted` hears the new lease id before the
/// put, so by the time a watcher sees the key, the id is already published.
async fn grant_and_put(
    client: &mut Client,
    config: &EtcdConfig,
    key: &str,
    value: &[u8],
    ttl_secs: i64,
    granted: impl FnOnce(i64),
) -> Result<(i64, i64), DiscoveryError> {
    let grant = call(
        config,
        "granting the worker's lease",
        client.lease_grant(ttl_secs, None),
    )
    .await?;
    if !grant.error().is_empty() || grant.ttl() <= 0 {
        return Err(DiscoveryError::Lease {
            endpoints: config.shown(),
            reason: format!(
                "asked for {ttl_secs} s, got TTL {} s (error: {:?})",
                grant.ttl(),
                grant.error()
            ),
        });
    }
    let id = grant.id();
    granted(id);
    let put = call(
        config,
        "putting the worker's key",
        client.put(key, value, Some(PutOptions::new().with_lease(id))),
    )
    .await;
    if let Err(e) = put {
        // Best effort: a lease with no key expires harmlessly anyway.
        let _ = tokio::time::timeout(REQUEST_TIMEOUT, client.lease_revoke(id)).await;
        return Err(e);
    }
    Ok((id, grant.ttl()))
}

/// The state of the keep-alive task.
struct KeepAlive {
    /// Replaced by a fresh one before every retry (see the module doc).
    client: Client,
    config: EtcdConfig,
    key: String,
    value: Vec<u8>,
    /// The TTL asked for, used when re-granting.
    ttl_secs: i64,
    /// The TTL etcd granted last.
    granted: i64,
    lease: Arc<AtomicI64>,
}

/// Why one keep-alive stream ended.
enum StreamEnd {
    /// etcd said the lease no longer exists.
    LeaseLost,
    /// The stream could not be opened or broke; the lease may still exist.
    Broken(String),
}

impl KeepAlive {
    /// A third of the granted TTL, at least 100 ms.
    fn interval(&self) -> Duration {
        let ttl_ms = u64::try_from(self.granted.max(1)).unwrap_or(1) * 1000;
        Duration::from_millis((ttl_ms / 3).max(100))
    }

    fn backoff(&self) -> Backoff {
        let first = Duration::from_millis(200);
        Backoff::new(first, self.interval().max(first))
    }

    async fn run(mut self) {
        let mut backoff = self.backoff();
        loop {
            match self.follow_stream(&mut backoff).await {
                StreamEnd::LeaseLost => {
                    tracing::warn!(key = %self.key, "etcd lease lost (expired?); registering again");
                    self.regrant(&mut backoff).await;
                }
                StreamEnd::Broken(reason) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(key = %self.key, %reason, ?delay, "etcd lease keep-alive failed; retrying");
                    tokio::time::sleep(delay).await;
                    self.reconnect().await;
                }
            }
        }
    }

    /// Opens a keep-alive stream and renews every [`Self::interval`] until
    /// the stream breaks or the lease is gone.
    async fn follow_stream(&mut self, backoff: &mut Backoff) -> StreamEnd {
        let id = self.lease.load(Ordering::Acquire);
        let opened = call(
            &self.config,
            "opening the lease keep-alive stream",
            self.client.lease_keep_alive(id),
        )
        .await;
        let (mut keeper, mut stream) = match opened {
            Ok(pair) => pair,
            // etcd-client sends the first renewal while opening and reports
            // a lease that is gone (it expired while etcd was down, paused
            // or partitioned away) as this error: retrying the same lease
            // would never succeed.
            Err(DiscoveryError::Request {
                source: etcd_client::Error::LeaseKeepAliveError(reason),
                ..
            }) if reason.contains("not found") => return StreamEnd::LeaseLost,
            Err(e) => return StreamEnd::Broken(e.to_string()),
        };
        loop {
            match tokio::time::timeout(REQUEST_TIMEOUT, keeper.keep_alive()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return StreamEnd::Broken(format!("sending a renewal: {e}")),
                Err(_) => return StreamEnd::Broken("sending a renewal timed out".to_string()),
            }
            match tokio::time::timeout(REQUEST_TIMEOUT, stream.message()).await {
                Ok(Ok(Some(resp))) if resp.ttl() <= 0 => return StreamEnd::LeaseLost,
                Ok(Ok(Some(resp))) => {
                    self.granted = resp.ttl();
                    backoff.reset();
                    if let Err(e) = self.restore_key().await {
                        tracing::warn!(key = %self.key, error = %e, "checking the worker's etcd key failed");
                    }
                }
                Ok(Ok(None)) => return StreamEnd::Broken("etcd closed the stream".to_string()),
                Ok(Err(e)) => return StreamEnd::Broken(format!("renewing: {e}")),
                Err(_) => return StreamEnd::Broken("no renewal answer in time".to_string()),
            }
            tokio::time::sleep(self.interval()).await;
        }
    }

    /// Puts the key back under the current lease when it is gone or holds
    /// something else (deleted by hand, overwritten by a stray process or
    /// an operator's tool): the lease alone would keep a worker alive in
    /// etcd but invisible to routers.
    async fn restore_key(&mut self) -> Result<(), DiscoveryError> {
        let id = self.lease.load(Ordering::Acquire);
        let got = call(
            &self.config,
            "reading the worker's key",
            self.client.get(self.key.as_str(), None),
        )
        .await?;
        let ours = got
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == self.value.as_slice() && kv.lease() == id);
        if ours {
            return Ok(());
        }
        tracing::warn!(key = %self.key, lease = id, "the worker's etcd key was deleted or overwritten; putting it back");
        call(
            &self.config,
            "putting the worker's key back",
            self.client.put(
                self.key.as_str(),
                self.value.clone(),
                Some(PutOptions::new().with_lease(id)),
            ),
        )
        .await?;
        Ok(())
    }

    /// Grants a new lease and puts the key again, retrying until it works.
    async fn regrant(&mut self, backoff: &mut Backoff) {
        loop {
            let lease = Arc::clone(&self.lease);
            let result = grant_and_put(
                &mut self.client,
                &self.config,
                &self.key,
                &self.value,
                self.ttl_secs,
                |id| lease.store(id, Ordering::Release),
            )
            .await;
            match result {
                Ok((id, granted)) => {
                    self.lease.store(id, Ordering::Release);
                    self.granted = granted;
                    backoff.reset();
                    tracing::info!(key = %self.key, lease = id, "registered in etcd again");
                    return;
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(key = %self.key, error = %e, ?delay, "re-registering failed; retrying");
                    tokio::time::sleep(delay).await;
                    self.reconnect().await;
                }
            }
        }
    }

    /// Replaces the client with a fresh one (which authenticates again when
    /// a user is configured). On failure the old client stays: the next
    /// attempt fails on it and reconnects again after the backoff.
    async fn reconnect(&mut self) {
        match connect(&self.config).await {
            Ok(client) => self.client = client,
            Err(e) => tracing::warn!(key = %self.key, error = %e, "reconnecting to etcd failed"),
        }
    }
}
