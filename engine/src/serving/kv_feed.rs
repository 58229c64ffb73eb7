//! The prefix-cache feed a router follows: which blocks an engine holds,
//! as one snapshot and then numbered changes.
//!
//! Both ends are bounded, because the feed's readers are remote peers the
//! engine must never wait on. An engine takes at most
//! [`MAX_KV_SUBSCRIBERS`] subscribers at once ([`KvFeedSlots`] counts them;
//! a [`KvSubscription`] holds its slot until dropped), and each has a
//! backlog of [`KV_FEED_BACKLOG`] messages: the engine thread only ever
//! `try_send`s, and a subscriber whose backlog is full is dropped, its feed
//! ending. Routers resubscribe after any gap or end, and a new
//! subscription starts with a fresh snapshot, so dropping a slow reader
//! costs it one snapshot, not correctness.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{Receiver, Sender};

use tandem_block_hash::SetDigest;

use crate::kv_cache::{AnnouncedChanges, CacheEvent};

/// Subscribers one engine feeds at once. A router keeps one per worker
/// (two while it resubscribes), so 16 leaves room for several routers and
/// operators' tools; more is someone opening feeds without end.
pub const MAX_KV_SUBSCRIBERS: usize = 16;

/// Messages (one per engine step with cache changes) a subscriber may fall
/// behind before it is dropped: seconds of a busy engine's steps.
pub const KV_FEED_BACKLOG: usize = 1024;

/// One snapshot, then numbered changes. Sequence numbers are per engine
/// and increase by one per event, so a gap means a lost message
/// (resubscribe for a new snapshot). Each message carries the digest of
/// the announced set once it is applied, which the worker passes on to its
/// followers now and then so they can check their copy, and whether the
/// pool's announced set is then prefix-closed
/// ([`PrefixClosure`](tandem_block_hash::PrefixClosure)), which routers use
/// to binary-search its matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvFeed {
    /// Every cached block as of event `seq` (parents first).
    Snapshot {
        seq: u64,
        events: Vec<CacheEvent>,
        digest: SetDigest,
        pool_closed: bool,
    },
    /// Changes numbered `seq`, in order.
    Events {
        events: Vec<(u64, CacheEvent)>,
        digest: SetDigest,
        pool_closed: bool,
    },
}

impl KvFeed {
    /// The number of the last event this message accounts for, and the
    /// announced set's digest after it.
    pub fn digest(&self) -> (u64, SetDigest) {
        match self {
            Self::Snapshot { seq, digest, .. } => (*seq, *digest),
            Self::Events { events, digest, .. } => (events.last().map_or(0, |e| e.0), *digest),
        }
    }
}

/// A subscription refused: the engine already feeds its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this engine already feeds {limit} KV event subscribers (the limit)")]
pub struct TooManyKvSubscribers {
    pub limit: usize,
}

/// Counts an engine's subscriptions against [`MAX_KV_SUBSCRIBERS`].
#[derive(Debug, Default, Clone)]
pub(crate) struct KvFeedSlots(Arc<AtomicUsize>);

impl KvFeedSlots {
    /// A slot and the channel its feed arrives on, or the refusal.
    pub fn take(&self) -> Result<(Sender<KvFeed>, KvSubscription), TooManyKvSubscribers> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_KV_SUBSCRIBERS).then_some(n + 1)
            })
            .map_err(|_| TooManyKvSubscribers {
                limit: MAX_KV_SUBSCRIBERS,
            })?;
        let (tx, rx) = tokio::sync::mpsc::channel(KV_FEED_BACKLOG);
        let sub = KvSubscription {
            feed: rx,
            slots: self.clone(),
        };
        Ok((tx, sub))
    }
}

/// One subscriber's feed; dropping it frees its slot (and the engine drops
/// the sending side at its next publish).
#[derive(Debug)]
pub struct KvSubscription {
    feed: Receiver<KvFeed>,
    slots: KvFeedSlots,
}

impl KvSubscription {
    /// The next message; `None` once the engine stopped or dropped this
    /// subscriber for falling behind.
    pub async fn recv(&mut self) -> Option<KvFeed> {
        self.feed.recv().await
    }
}

impl Drop for KvSubscription {
    fn drop(&mut self) {
        self.slots.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The engine thread's side: the sequence counter and the subscribers.
#[derive(Debug, Default)]
pub(crate) struct KvFeedPublisher {
    subscribers: Vec<Sender<KvFeed>>,
    seq: u64,
}

impl KvFeedPublisher {
    /// Adds `sink` with `snapshot` (every cached block now) as its first
    /// message. Call after [`publish`](Self::publish)ing pending changes,
    /// so the snapshot's number is the last event's. `pool_closed`: the
    /// snapshot's pool blocks are prefix-closed.
    pub fn subscribe(
        &mut self,
        sink: Sender<KvFeed>,
        snapshot: Vec<CacheEvent>,
        pool_closed: bool,
    ) {
        let digest = SetDigest::of(snapshot.iter().filter_map(|e| match e {
            CacheEvent::Stored { .. } | CacheEvent::DiskStored { .. } => Some(e.digest_member()),
            CacheEvent::Removed { .. } | CacheEvent::DiskRemoved { .. } => None,
        }));
        let first = KvFeed::Snapshot {
            seq: self.seq,
            events: snapshot,
            digest,
            pool_closed,
        };
        if sink.try_send(first).is_ok() {
            self.subscribers.push(sink);
        }
    }

    /// Numbers `changes`' events and sends them, with the announced set's
    /// digest and closure after them, to every subscriber that keeps up.
    pub fn publish(&mut self, changes: AnnouncedChanges) {
        let AnnouncedChanges {
            events,
            digest,
            prefix_closed: pool_closed,
        } = changes;
        if events.is_empty() {
            return;
        }
        let numbered: Vec<(u64, CacheEvent)> = events
            .into_iter()
            .map(|e| {
                self.seq += 1;
                (self.seq, e)
            })
            .collect();
        self.subscribers.retain(|s| {
            let feed = KvFeed::Events {
                events: numbered.clone(),
                digest,
                pool_closed,
            };
            match s.try_send(feed) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    tracing::warn!(
                        backlog = KV_FEED_BACKLOG,
                        "a KV event subscriber fell behind; its feed ends (it resubscribes)"
                    );
                    false
                }
                Err(TrySendError::Closed(_)) => false,
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64) -> CacheEvent {
        CacheEvent::Stored { parent: 0, hash }
    }

    fn changes(events: Vec<CacheEvent>) -> AnnouncedChanges {
        AnnouncedChanges {
            events,
            digest: SetDigest::default(),
            prefix_closed: true,
        }
    }

    #[test]
    fn subscriptions_past_the_limit_are_refused_until_one_is_dropped() {
        let slots = KvFeedSlots::default();
        let mut held: Vec<_> = (0..MAX_KV_SUBSCRIBERS)
            .map(|_| slots.take().expect("under the limit"))
            .collect();
        let refused = slots.take().expect_err("one too many");
        assert_eq!(refused.limit, MAX_KV_SUBSCRIBERS);
        held.pop();
        assert!(
            slots.take().is_ok(),
            "a dropped subscription frees its slot"
        );
    }

    #[test]
    fn a_subscriber_that_stops_reading_is_dropped_and_the_rest_are_fed() {
        let slots = KvFeedSlots::default();
        let mut publisher = KvFeedPublisher::default();
        let (slow_tx, mut slow) = slots.take().expect("slot");
        let (fast_tx, mut fast) = slots.take().expect("slot");
        publisher.subscribe(slow_tx, Vec::new(), true);
        publisher.subscribe(fast_tx, Vec::new(), true);
        assert!(matches!(
            fast.feed.try_recv().ok(),
            Some(KvFeed::Snapshot { seq: 0, .. })
        ));
        // The slow one holds its snapshot plus a full backlog, then one more.
        for i in 0..KV_FEED_BACKLOG as u64 {
            publisher.publish(changes(vec![stored(i)]));
            assert!(fast.feed.try_recv().ok().is_some());
        }
        assert_eq!(publisher.subscribers.len(), 1, "the slow one is gone");
        publisher.publish(changes(vec![stored(u64::MAX)]));
        assert_eq!(
            fast.feed.try_recv().ok(),
            Some(KvFeed::Events {
                events: vec![(KV_FEED_BACKLOG as u64 + 1, stored(u64::MAX))],
                digest: SetDigest::default(),
                pool_closed: true,
            })
        );
        // The slow one reads what it was sent, then its feed ends.
        let mut read = 0;
        while slow.feed.try_recv().is_ok() {
            read += 1;
        }
        assert_eq!(
            read, KV_FEED_BACKLOG,
            "the snapshot and all but the last change"
        );
    }
}
