//! An in-process [`Transport`] for unit tests of the workers.
//!
//! Listeners register under a name in a registry shared by every clone of
//! one [`InProcTransport`]; endpoints are `"inproc://name"`. It keeps the
//! semantics of the real transports — the handshake's token and layout
//! checks (refused on both sides: the listener's sink hears about it through
//! [`KvSink::peer_error`]), ordered delivery, one completion per transfer,
//! failure of open transfers when either side goes away — by running the
//! same session and receiver state machines as TCP with a channel in place of
//! the socket. Blocks are moved, not serialised.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};

use crate::session::{
    ChannelSession, Command, Completions, ReceiverCore, TransferCounters, COMMAND_QUEUE,
};
use crate::{
    token_eq, KvLayoutDescriptor, KvSink, Listener, Session, TransferCounts, TransferError,
    Transport,
};

const SCHEME: &str = "inproc://";

#[derive(Clone)]
struct Entry {
    layout: KvLayoutDescriptor,
    sink: Arc<dyn KvSink>,
    token: Arc<str>,
    /// The listening handle's counters (its receivers count there).
    counters: Arc<TransferCounters>,
    /// Fires (by closing) when the listener is dropped.
    shutdown: watch::Receiver<()>,
}

#[derive(Default)]
struct Registry {
    endpoints: HashMap<String, Entry>,
    next_id: u64,
}

type SharedRegistry = Arc<Mutex<Registry>>;

fn lock(registry: &SharedRegistry) -> MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The in-process transport. Clones share the registry; use
/// [`with_token`](Self::with_token) for a handle with another cluster token
/// on the same registry.
#[derive(Clone)]
pub struct InProcTransport {
    registry: SharedRegistry,
    token: Arc<str>,
    counters: Arc<TransferCounters>,
}

impl std::fmt::Debug for InProcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcTransport")
            .field("endpoints", &lock(&self.registry).endpoints.len())
            .finish_non_exhaustive()
    }
}

impl InProcTransport {
    /// A fresh registry, with `cluster_token` for this handle.
    pub fn new(cluster_token: &str) -> Self {
        Self {
            registry: Arc::default(),
            token: Arc::from(cluster_token),
            counters: Arc::default(),
        }
    }

    /// A handle on the same registry presenting another cluster token.
    pub fn with_token(&self, cluster_token: &str) -> Self {
        Self {
            registry: self.registry.clone(),
            token: Arc::from(cluster_token),
            counters: Arc::default(),
        }
    }
}

/// Unregisters the endpoint and shuts its sessions down when dropped.
struct Guard {
    registry: SharedRegistry,
    name: String,
    _shutdown: watch::Sender<()>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        lock(&self.registry).endpoints.remove(&self.name);
    }
}

#[async_trait]
impl Transport for InProcTransport {
    fn counts(&self) -> TransferCounts {
        self.counters.counts()
    }

    async fn listen(
        &self,
        bind: &str,
        layout: KvLayoutDescriptor,
        sink: Arc<dyn KvSink>,
    ) -> Result<Listener, TransferError> {
        layout.validate()?;
        let name = bind
            .strip_prefix(SCHEME)
            .ok_or_else(|| TransferError::BadEndpoint {
                endpoint: bind.to_string(),
                reason: format!("in-process endpoints start with {SCHEME}"),
            })?;
        let (shutdown_tx, shutdown) = watch::channel(());
        let mut registry = lock(&self.registry);
        let name = if name.is_empty() {
            registry.next_id += 1;
            format!("listener-{}", registry.next_id)
        } else {
            name.to_string()
        };
        if registry.endpoints.contains_key(&name) {
            return Err(TransferError::BadEndpoint {
                endpoint: bind.to_string(),
                reason: "already in use".into(),
            });
        }
        registry.endpoints.insert(
            name.clone(),
            Entry {
                layout,
                sink,
                token: self.token.clone(),
                counters: self.counters.clone(),
                shutdown,
            },
        );
        let guard = Guard {
            registry: self.registry.clone(),
            name: name.clone(),
            _shutdown: shutdown_tx,
        };
        Ok(Listener::new(format!("{SCHEME}{name}"), Box::new(guard)))
    }

    async fn connect(
        &self,
        endpoint: &str,
        layout: KvLayoutDescriptor,
    ) -> Result<Box<dyn Session>, TransferError> {
        layout.validate()?;
        let bad = |reason: &str| TransferError::BadEndpoint {
            endpoint: endpoint.to_string(),
            reason: reason.to_string(),
        };
        let name = endpoint
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad("in-process endpoints start with inproc://"))?;
        let entry = lock(&self.registry)
            .endpoints
            .get(name)
            .cloned()
            .ok_or_else(|| bad("no listener by that name"))?;
        let peer = "in-process sender";
        if !token_eq(self.token.as_bytes(), entry.token.as_bytes()) {
            entry.sink.peer_error(peer, &TransferError::BadToken);
            return Err(TransferError::BadToken);
        }
        if let Err(theirs) = entry.layout.check_compatible(&layout) {
            entry.sink.peer_error(peer, &theirs);
            return Err(layout
                .check_compatible(&entry.layout)
                .err()
                .unwrap_or(theirs));
        }
        let completions = Arc::new(Completions::new(self.counters.clone()));
        let (commands, queue) = mpsc::channel(COMMAND_QUEUE);
        let core = ReceiverCore::new(entry.sink.clone(), &entry.layout, entry.counters.clone());
        let peer_num_blocks = entry.sink.num_blocks();
        tokio::spawn(receive(queue, core, completions.clone(), entry.shutdown));
        Ok(Box::new(ChannelSession {
            endpoint: endpoint.to_string(),
            layout,
            peer_num_blocks,
            commands,
            completions,
            _tasks: Vec::new(),
        }))
    }
}

/// The receiving end of one in-process session.
async fn receive(
    mut queue: mpsc::Receiver<Command>,
    mut core: ReceiverCore,
    completions: Arc<Completions>,
    mut shutdown: watch::Receiver<()>,
) {
    loop {
        let command = tokio::select! {
            command = queue.recv() => command,
            _ = shutdown.changed() => {
                let reason = "the listener shut down";
                core.close(reason);
                completions.fail_all(TransferError::ConnectionLost(reason.into()));
                return;
            }
        };
        let Some(command) = command else {
            core.close("the sender dropped the session with the transfer open");
            return;
        };
        match command {
            Command::Write { transfer, blocks } => {
                if let Err(e) = core.begin(transfer) {
                    core.close(&e.to_string());
                    completions.fail_all(e);
                    return;
                }
                for b in blocks {
                    if let Some(done) = core.block(transfer, b.layer, b.dst_block, &b.k, &b.v) {
                        let _ = completions.on_done(done);
                    }
                }
            }
            Command::Finish(transfer) => {
                if let Some(done) = core.finish(transfer) {
                    let _ = completions.on_done(done);
                }
            }
            Command::Abort(transfer) => core.abort(transfer),
        }
    }
}
