//! Membership without etcd: a fixed worker list.
//!
//! A single-machine deployment or a test passes `--prefill host:port
//! --decode host:port` instead of etcd endpoints. [`StaticMembership`] turns
//! that list into the same `(snapshot, events)` pair that [`crate::watch`]
//! returns, with an event stream that never yields, so the router has one
//! code path for both. A static worker's id is its address (unique per role,
//! checked), and its payload is empty: the router learns the rest from the
//! worker itself.

use std::collections::BTreeSet;

use crate::{DiscoveryError, MembershipEvents, Role, WorkerRecord};

/// A fixed set of workers (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticMembership {
    workers: Vec<WorkerRecord>,
}

impl StaticMembership {
    /// The workers `(role, "host:port")`, in the order given. Refuses an
    /// empty address, one with a scheme or path (`/`), and duplicates.
    pub fn new(
        workers: impl IntoIterator<Item = (Role, String)>,
    ) -> Result<StaticMembership, DiscoveryError> {
        let mut seen = BTreeSet::new();
        let mut records = Vec::new();
        for (role, addr) in workers {
            if addr.is_empty() || addr.contains('/') || addr.chars().any(char::is_control) {
                return Err(DiscoveryError::InvalidName {
                    what: "static worker address",
                    value: addr,
                    reason: "expected host:port, without a scheme or path",
                });
            }
            if !seen.insert((role, addr.clone())) {
                return Err(DiscoveryError::DuplicateStaticWorker { role, addr });
            }
            records.push(WorkerRecord {
                role,
                id: addr.clone(),
                addr,
                payload: Vec::new(),
            });
        }
        Ok(StaticMembership { workers: records })
    }

    /// The workers, in the order given.
    pub fn snapshot(&self) -> Vec<WorkerRecord> {
        self.workers.clone()
    }

    /// The snapshot and an event stream that never yields: the same shape
    /// as [`crate::watch`].
    pub fn watch(&self) -> (Vec<WorkerRecord>, MembershipEvents) {
        (self.snapshot(), MembershipEvents::never())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn the_snapshot_lists_the_workers_and_the_stream_stays_silent() {
        let list = StaticMembership::new([
            (Role::Prefill, "127.0.0.1:5001".to_string()),
            (Role::Decode, "127.0.0.1:5002".to_string()),
            (Role::Decode, "127.0.0.1:5003".to_string()),
        ])
        .expect("valid list");
        let (snapshot, mut events) = list.watch();
        let shown: Vec<_> = snapshot
            .iter()
            .map(|w| (w.role, w.id.as_str(), w.addr.as_str(), w.payload.len()))
            .collect();
        assert_eq!(
            shown,
            [
                (Role::Prefill, "127.0.0.1:5001", "127.0.0.1:5001", 0),
                (Role::Decode, "127.0.0.1:5002", "127.0.0.1:5002", 0),
                (Role::Decode, "127.0.0.1:5003", "127.0.0.1:5003", 0),
            ]
        );
        let waited = tokio::time::timeout(Duration::from_millis(50), events.recv()).await;
        assert!(waited.is_err(), "a static list never changes: {waited:?}");
    }

    #[test]
    fn bad_and_duplicate_addresses_are_refused() {
        let dup = StaticMembership::new([
            (Role::Decode, "h:1".to_string()),
            (Role::Decode, "h:1".to_string()),
        ])
        .expect_err("duplicate");
        assert!(dup.to_string().contains("twice"), "{dup}");
        // The same address in both roles is two workers.
        StaticMembership::new([
            (Role::Prefill, "h:1".to_string()),
            (Role::Decode, "h:1".to_string()),
        ])
        .expect("distinct roles");
        for bad in ["", "http://h:1"] {
            let err =
                StaticMembership::new([(Role::Decode, bad.to_string())]).expect_err("bad address");
            assert!(err.to_string().contains("host:port"), "{err}");
        }
    }
}
