//! The router's side of etcd membership: which worker id holds which
//! address, and what the worker pool must do when records come and go.
//!
//! Membership is by identity. The pool routes by address, but a record is
//! keyed by its worker id, so the two can disagree: a worker restarted on
//! the same address under a new id registers (`Up`) before the old id's
//! lease expires (`Down`). Removing "the address of the id that left" would
//! then drop the live worker. [`AddressBook`] counts the ids behind each
//! address and removes an address only when its last id is gone; an id
//! that re-registers under a new address releases the old one.
//!
//! A record the pool cannot use (an address it cannot parse) is logged and
//! skipped, at start and on watch: one bad record under the prefix must not
//! stop a router from starting.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_discovery::{MembershipEvent, WorkerRecord};
use tandem_router::{Cluster, Role};

/// What the worker pool must do after one membership change.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PoolChange {
    /// Start routing to this address (adding a known one is a no-op).
    pub add: Option<(Role, String)>,
    /// Stop routing to this address: no id holds it any more.
    pub remove: Option<String>,
}

/// Worker ids and the addresses they registered.
#[derive(Debug, Default)]
pub struct AddressBook {
    by_id: HashMap<(Role, String), String>,
}

impl AddressBook {
    /// Whether any id still holds `addr`.
    fn held(&self, addr: &str) -> bool {
        self.by_id.values().any(|a| a == addr)
    }

    /// A worker registered (or rewrote its record).
    pub fn up(&mut self, record: &WorkerRecord) -> PoolChange {
        let key = (record.role, record.id.clone());
        let old = self.by_id.insert(key, record.addr.clone());
        let remove = old.filter(|old| *old != record.addr && !self.held(old));
        PoolChange {
            add: Some((record.role, record.addr.clone())),
            remove,
        }
    }

    /// A worker's record is gone (deregistered, expired, deleted).
    pub fn down(&mut self, role: Role, id: &str) -> PoolChange {
        let remove = self
            .by_id
            .remove(&(role, id.to_string()))
            .filter(|addr| !self.held(addr));
        PoolChange { add: None, remove }
    }

    /// An `add` the pool refused (a malformed address): forget the id, so
    /// it holds nothing.
    fn refused(&mut self, record: &WorkerRecord) {
        self.by_id.remove(&(record.role, record.id.clone()));
    }
}

/// Applies one change to the pool; a record it cannot use is skipped.
fn apply(
    cluster: &Arc<Cluster>,
    book: &mut AddressBook,
    record: Option<&WorkerRecord>,
    change: PoolChange,
) {
    if let Some(addr) = change.remove {
        tracing::info!(%addr, "worker address left the membership");
        cluster.remove(&addr);
    }
    if let Some((role, addr)) = change.add {
        if let Err(error) = cluster.add(role, &addr) {
            tracing::warn!(%error, %addr, "skipping a worker record the router cannot use");
            if let Some(r) = record {
                book.refused(r);
            }
        }
    }
}

/// Routes to the snapshot's workers, then follows the events for as long
/// as the stream lasts.
pub fn follow(
    cluster: Arc<Cluster>,
    snapshot: Vec<WorkerRecord>,
    mut events: tandem_discovery::MembershipEvents,
) {
    let mut book = AddressBook::default();
    for r in &snapshot {
        let change = book.up(r);
        apply(&cluster, &mut book, Some(r), change);
    }
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            match ev {
                MembershipEvent::Up(r) => {
                    tracing::info!(role = %r.role, id = %r.id, addr = %r.addr, "worker joined");
                    let change = book.up(&r);
                    apply(&cluster, &mut book, Some(&r), change);
                }
                MembershipEvent::Down { role, id } => {
                    tracing::info!(%role, %id, "worker left");
                    let change = book.down(role, &id);
                    apply(&cluster, &mut book, None, change);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, addr: &str) -> WorkerRecord {
        WorkerRecord {
            role: Role::Decode,
            id: id.into(),
            addr: addr.into(),
            payload: Vec::new(),
        }
    }

    #[test]
    fn a_restart_on_the_same_address_keeps_the_address_when_the_old_id_expires() {
        let mut book = AddressBook::default();
        book.up(&record("d-old", "127.0.0.1:7001"));
        // The new process registers before the old lease runs out ...
        let change = book.up(&record("d-new", "127.0.0.1:7001"));
        assert_eq!(change.remove, None);
        // ... and the old id's expiry must not take the address away.
        assert_eq!(book.down(Role::Decode, "d-old"), PoolChange::default());
        assert_eq!(
            book.down(Role::Decode, "d-new").remove.as_deref(),
            Some("127.0.0.1:7001")
        );
    }

    #[test]
    fn an_id_that_moves_releases_its_old_address() {
        let mut book = AddressBook::default();
        book.up(&record("d0", "127.0.0.1:7001"));
        let change = book.up(&record("d0", "127.0.0.1:7002"));
        assert_eq!(change.remove.as_deref(), Some("127.0.0.1:7001"));
        assert_eq!(
            change.add,
            Some((Role::Decode, "127.0.0.1:7002".to_string()))
        );
        // Rewriting the same record changes nothing to remove.
        assert_eq!(book.up(&record("d0", "127.0.0.1:7002")).remove, None);
    }

    #[test]
    fn the_same_id_in_both_roles_is_two_workers() {
        let mut book = AddressBook::default();
        book.up(&record("w", "127.0.0.1:7001"));
        let prefill = WorkerRecord {
            role: Role::Prefill,
            ..record("w", "127.0.0.1:7002")
        };
        book.up(&prefill);
        assert_eq!(
            book.down(Role::Prefill, "w").remove.as_deref(),
            Some("127.0.0.1:7002")
        );
        assert_eq!(book.down(Role::Prefill, "w"), PoolChange::default());
    }
}
