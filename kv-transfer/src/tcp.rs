//! KV transfer over plain TCP on tokio: works on every machine, no RDMA.
//!
//! One connection per session. After the handshake (magic, version, layout,
//! cluster token; see the wire format in the `protocol` module's source) the
//! sender streams frames that each carry many blocks, and the receiver sends
//! back one `DONE` per transfer on the same connection.
//!
//! Sender: [`Session`] calls queue commands on a bounded
//! channel; one writer task packs them into `WRITE` frames of about 4 MiB
//! (coalescing whatever else is queued) and writes each batch with vectored
//! writes — the block headers of a frame are one buffer and the K/V payloads
//! go from the caller's `Bytes` to the socket with no copy and no per-block
//! syscall. Nothing waits for a per-block reply. A second task reads the
//! `DONE`s and resolves `finish` calls. `TCP_NODELAY` is set so the small
//! `FINISH`/`DONE` frames are not held back by Nagle's algorithm.
//!
//! Receiver: one task per connection reads a frame's header and block table,
//! then the payloads in chunks of about 256 KiB of whole blocks (cache-sized)
//! into one reused buffer, and calls the sink per block; it writes `DONE` frames from
//! the same task (a peer that does not read its acks stalls only itself).
//! Every length is validated against the layout before anything is
//! allocated, so memory per connection stays bounded whatever a peer sends.
//! A protocol error closes that connection (after a best-effort `CLOSE`
//! frame naming it) and fails its open transfers; the listener keeps
//! accepting others.
//!
//! Peers are authenticated by the cluster token without sending it (see
//! `handshake`).

use std::io::IoSlice;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Buf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::handshake::{client_handshake, server_handshake};
use crate::protocol::{self, Segments};
use crate::session::{
    AbortOnDrop, ChannelSession, Command, Completions, Done, ReceiverCore, TransferCounters,
    COMMAND_QUEUE,
};
use crate::{
    KvLayoutDescriptor, KvSink, Listener, Session, TransferCounts, TransferError, Transport,
};

/// Receive payloads in chunks of about this many bytes (whole blocks).
const PAYLOAD_CHUNK_BYTES: usize = 256 << 10;
/// Read buffer of a connection.
const READ_BUFFER_BYTES: usize = 256 << 10;
/// Slices per vectored write.
const MAX_IOVECS: usize = 256;

/// Settings of a [`TcpTransport`].
#[derive(Clone)]
pub struct TcpConfig {
    /// The shared secret every worker of one cluster is configured with; a
    /// peer with another token is refused (at most 1024 bytes).
    pub cluster_token: String,
    /// Limit on establishing the TCP connection.
    pub connect_timeout: Duration,
    /// Limit on the handshake, on both sides (a peer that connects and says
    /// nothing is dropped after it).
    pub handshake_timeout: Duration,
    /// Connections a listener serves at once; one more is closed at
    /// accept. With the handshake limit this bounds what unauthenticated
    /// peers can hold: this many connections × about 512 KiB of buffers,
    /// each for at most `handshake_timeout`.
    pub max_connections: usize,
}

/// [`TcpConfig::max_connections`]'s default. A decode worker's listener
/// has one connection per prefill worker that sends to it (sessions are
/// reused), so 256 leaves room for a large pool; 256 × 512 KiB is 128 MiB
/// at most.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

impl TcpConfig {
    /// Defaults (5 s connect, 5 s handshake, [`DEFAULT_MAX_CONNECTIONS`])
    /// with `cluster_token`.
    pub fn new(cluster_token: impl Into<String>) -> Self {
        Self {
            cluster_token: cluster_token.into(),
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl std::fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConfig")
            .field("cluster_token", &"<redacted>")
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

/// The TCP [`Transport`]. Endpoints are `"ip:port"`.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    config: Arc<TcpConfig>,
    counters: Arc<TransferCounters>,
}

impl TcpTransport {
    /// A transport with default timeouts and `cluster_token`.
    pub fn new(cluster_token: impl Into<String>) -> Self {
        Self::with_config(TcpConfig::new(cluster_token))
    }

    /// A transport with explicit settings.
    pub fn with_config(config: TcpConfig) -> Self {
        Self {
            config: Arc::new(config),
            counters: Arc::default(),
        }
    }

    fn check_config(&self) -> Result<(), TransferError> {
        if self.config.cluster_token.len() > protocol::MAX_TOKEN_BYTES {
            return Err(TransferError::Config(format!(
                "the cluster token is {} bytes; at most {} are allowed",
                self.config.cluster_token.len(),
                protocol::MAX_TOKEN_BYTES
            )));
        }
        Ok(())
    }
}

/// What every connection of one listener needs.
struct ListenCtx {
    layout: KvLayoutDescriptor,
    sink: Arc<dyn KvSink>,
    config: Arc<TcpConfig>,
    counters: Arc<TransferCounters>,
}

pub(crate) fn timeout_error(during: &'static str, limit: Duration) -> TransferError {
    TransferError::Timeout {
        during,
        millis: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Maps a read error to a lost connection (EOF mid-message included).
/// A TCP listener on `bind` and the address it got (the port, when `bind`
/// asked for 0): the receiving side of both transports.
pub(crate) async fn bind_listener(bind: &str) -> Result<(TcpListener, String), TransferError> {
    let listener = TcpListener::bind(bind)
        .await
        .map_err(|e| TransferError::BadEndpoint {
            endpoint: bind.to_string(),
            reason: format!("cannot listen: {e}"),
        })?;
    let endpoint = listener
        .local_addr()
        .map_err(|e| TransferError::io("reading the listener's address", &e))?
        .to_string();
    Ok((listener, endpoint))
}

/// A TCP connection to `endpoint` within the connect timeout, with Nagle
/// off (each frame is sent whole), split for the writer and ack tasks:
/// the sending side of both transports (UCX's control channel is TCP).
pub(crate) async fn dial(
    endpoint: &str,
    config: &TcpConfig,
) -> Result<(OwnedReadHalf, OwnedWriteHalf), TransferError> {
    let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(endpoint))
        .await
        .map_err(|_| timeout_error("connecting", config.connect_timeout))?
        .map_err(|e| TransferError::BadEndpoint {
            endpoint: endpoint.to_string(),
            reason: format!("cannot connect: {e}"),
        })?;
    stream
        .set_nodelay(true)
        .map_err(|e| TransferError::io("setting TCP_NODELAY", &e))?;
    Ok(stream.into_split())
}

pub(crate) fn lost(peer: &str, err: &std::io::Error) -> TransferError {
    if err.kind() == std::io::ErrorKind::UnexpectedEof {
        TransferError::ConnectionLost(format!("{peer} closed the connection mid-message"))
    } else {
        TransferError::ConnectionLost(format!("{peer}: {err}"))
    }
}

#[async_trait]
impl Transport for TcpTransport {
    fn counts(&self) -> TransferCounts {
        self.counters.counts()
    }

    async fn listen(
        &self,
        bind: &str,
        layout: KvLayoutDescriptor,
        sink: Arc<dyn KvSink>,
    ) -> Result<Listener, TransferError> {
        self.check_config()?;
        layout.validate()?;
        let (listener, endpoint) = bind_listener(bind).await?;
        let ctx = Arc::new(ListenCtx {
            layout,
            sink,
            config: self.config.clone(),
            counters: self.counters.clone(),
        });
        let task = tokio::spawn(accept_loop(
            listener,
            ctx,
            self.config.max_connections,
            "tcp",
            serve_connection,
        ));
        Ok(Listener::new(endpoint, Box::new(AbortOnDrop(task))))
    }

    async fn connect(
        &self,
        endpoint: &str,
        layout: KvLayoutDescriptor,
    ) -> Result<Box<dyn Session>, TransferError> {
        self.check_config()?;
        layout.validate()?;
        let config = &self.config;
        let (mut reader, mut writer) = dial(endpoint, config).await?;
        let num_blocks = tokio::time::timeout(
            config.handshake_timeout,
            client_handshake(
                protocol::MAGIC,
                &mut reader,
                &mut writer,
                &layout,
                config,
                endpoint,
            ),
        )
        .await
        .map_err(|_| {
            timeout_error("waiting for the handshake reply", config.handshake_timeout)
        })??;

        let completions = Arc::new(Completions::new(self.counters.clone()));
        let (commands, queue) = mpsc::channel(COMMAND_QUEUE);
        tokio::spawn(write_loop(
            queue,
            writer,
            layout.block_payload_bytes(),
            completions.clone(),
            endpoint.to_string(),
        ));
        let acks = tokio::spawn(ack_loop(reader, completions.clone(), endpoint.to_string()));
        Ok(Box::new(ChannelSession::new(
            endpoint,
            layout,
            num_blocks,
            commands,
            completions,
            acks,
        )))
    }
}

/// Drains the session's commands into the socket.
async fn write_loop(
    mut queue: mpsc::Receiver<Command>,
    mut writer: OwnedWriteHalf,
    payload_bytes: usize,
    completions: Arc<Completions>,
    endpoint: String,
) {
    let blocks_per_frame =
        (protocol::TARGET_FRAME_BYTES / (payload_bytes + protocol::WRITE_ENTRY)).max(1);
    let encode = |out: &mut Segments, command: Command| match command {
        Command::Write { transfer, blocks } => {
            protocol::encode_writes(out, transfer, blocks, payload_bytes, blocks_per_frame)
        }
        Command::Finish(transfer) => {
            protocol::encode_control(out, protocol::FRAME_FINISH, transfer)
        }
        Command::Abort(transfer) => protocol::encode_control(out, protocol::FRAME_ABORT, transfer),
    };
    let mut out = Segments::default();
    while let Some(command) = queue.recv().await {
        encode(&mut out, command);
        while out.remaining() < protocol::TARGET_FRAME_BYTES {
            match queue.try_recv() {
                Ok(command) => encode(&mut out, command),
                Err(_) => break,
            }
        }
        if let Err(e) = write_segments(&mut writer, &mut out).await {
            completions.fail_all(TransferError::ConnectionLost(format!(
                "writing to {endpoint}: {e}"
            )));
            return;
        }
    }
    let _ = writer.shutdown().await;
}

async fn write_segments<W: AsyncWrite + Unpin>(
    writer: &mut W,
    out: &mut Segments,
) -> std::io::Result<()> {
    while out.has_remaining() {
        let written = {
            let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
            let n = out.chunks_vectored(&mut slices);
            writer.write_vectored(&slices[..n]).await?
        };
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        out.advance(written);
    }
    Ok(())
}

/// Reads the receiver's `DONE`s until the connection ends, then fails what
/// is still pending.
async fn ack_loop(reader: OwnedReadHalf, completions: Arc<Completions>, endpoint: String) {
    let mut reader = BufReader::new(reader);
    let max_body = 11 + protocol::MAX_MESSAGE_BYTES;
    let mut body = Vec::new();
    let err = loop {
        let mut header = [0u8; protocol::FRAME_HEADER];
        match read_header(&mut reader, &mut header).await {
            Ok(true) => {}
            Ok(false) => {
                break TransferError::ConnectionLost(format!("{endpoint} closed the connection"))
            }
            Err(e) => break lost(&endpoint, &e),
        }
        let len = frame_len(&header);
        if len > max_body {
            break TransferError::Protocol(format!(
                "{endpoint} sent a frame of {len} bytes; acknowledgements are at most {max_body}"
            ));
        }
        body.resize(len, 0);
        if let Err(e) = reader.read_exact(&mut body).await {
            break lost(&endpoint, &e);
        }
        let outcome = match header[0] {
            protocol::FRAME_DONE => {
                protocol::decode_done(&body).and_then(|done| completions.on_done(done))
            }
            protocol::FRAME_CLOSE => Err(protocol::closed_by_peer(&endpoint, &body)),
            other => Err(TransferError::Protocol(format!(
                "{endpoint} sent an unknown frame type {other:#04x}"
            ))),
        };
        if let Err(e) = outcome {
            break e;
        }
    };
    completions.fail_all(err);
}

pub(crate) fn frame_len(header: &[u8; protocol::FRAME_HEADER]) -> usize {
    u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize
}

/// Reads a frame header; `Ok(false)` on a clean end of stream before it.
pub(crate) async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &mut [u8; protocol::FRAME_HEADER],
) -> std::io::Result<bool> {
    if reader.read(&mut header[..1]).await? == 0 {
        return Ok(false);
    }
    reader.read_exact(&mut header[1..]).await?;
    Ok(true)
}

/// Accepts connections until its task is aborted, serving each on its own
/// task (aborted with it): the TCP transport's data connections and the UCX
/// transport's control connections alike.
pub(crate) async fn accept_loop<C, F, Fut>(
    listener: TcpListener,
    ctx: Arc<C>,
    max_connections: usize,
    transport: &'static str,
    serve: F,
) where
    C: Send + Sync + 'static,
    F: Fn(TcpStream, String, Arc<C>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) if connections.len() >= max_connections => {
                    // Closed at once: the peer sees it and may retry.
                    tracing::warn!(%peer, max_connections, transport,
                        "KV transfer listener: at its connection limit, closing a new connection");
                    drop(stream);
                }
                Ok((stream, peer)) => {
                    connections.spawn(serve(stream, peer.to_string(), ctx.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off a little.
                    tracing::warn!(error = %e, transport, "KV transfer listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

fn report(ctx: &ListenCtx, peer: &str, err: &TransferError) {
    tracing::warn!(%peer, error = %err, "KV transfer connection refused or failed");
    ctx.sink.peer_error(peer, err);
}

async fn serve_connection(stream: TcpStream, peer: String, ctx: Arc<ListenCtx>) {
    let _ = stream.set_nodelay(true);
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
    let limit = ctx.config.handshake_timeout;
    let handshake = tokio::time::timeout(
        limit,
        server_handshake(
            protocol::MAGIC,
            &mut reader,
            &mut writer,
            &ctx.layout,
            &ctx.config,
            ctx.sink.num_blocks(),
        ),
    )
    .await
    .unwrap_or_else(|_| Err(timeout_error("waiting for the sender's hello", limit)));
    if let Err(e) = handshake {
        report(&ctx, &peer, &e);
        linger_close(&mut reader, &mut writer).await;
        return;
    }
    let mut core = ReceiverCore::new(ctx.sink.clone(), &ctx.layout, ctx.counters.clone());
    match receive_frames(&mut reader, &mut writer, &mut core, &ctx.layout, &peer).await {
        Ok(()) => core.close("the sender closed the connection with the transfer open"),
        Err(e) => {
            let message = e.to_string();
            core.close(&message);
            report(&ctx, &peer, &e);
            let close = protocol::encode_close(&message);
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&close)).await;
        }
    }
}

/// Closes a refused connection gracefully: our side first (FIN, after the
/// refusal), then whatever the peer still sends is read and discarded
/// (bounded: 1 MiB, 500 ms), so closing with unread bytes does not reset
/// the connection and destroy the refusal before the peer reads it. Nothing
/// read here reaches the sink.
pub(crate) async fn linger_close<R: AsyncRead + Unpin>(
    reader: &mut R,
    writer: &mut OwnedWriteHalf,
) {
    let _ = writer.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 16 << 10];
        let mut left = 1usize << 20;
        while left > 0 {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
}

pub(crate) async fn send_done<W: AsyncWrite + Unpin>(
    writer: &mut W,
    done: Done,
    peer: &str,
) -> Result<(), TransferError> {
    writer
        .write_all(&protocol::encode_done(done.0, &done.1))
        .await
        .map_err(|e| TransferError::ConnectionLost(format!("acknowledging to {peer}: {e}")))
}

/// Reads frames until the sender closes the connection (`Ok`) or breaks the
/// protocol (`Err`).
async fn receive_frames<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut R,
    writer: &mut W,
    core: &mut ReceiverCore,
    layout: &KvLayoutDescriptor,
    peer: &str,
) -> Result<(), TransferError> {
    let block_layer_bytes = layout.block_layer_bytes();
    let per_block = layout.block_payload_bytes();
    let chunk_blocks = (PAYLOAD_CHUNK_BYTES / per_block).max(1);
    let mut table = Vec::new();
    let mut payload = Vec::new();
    loop {
        let mut header = [0u8; protocol::FRAME_HEADER];
        if !read_header(reader, &mut header)
            .await
            .map_err(|e| lost(peer, &e))?
        {
            return Ok(());
        }
        let len = frame_len(&header);
        match header[0] {
            protocol::FRAME_WRITE => {
                if !(protocol::WRITE_FIXED..=protocol::MAX_FRAME_BYTES).contains(&len) {
                    return Err(TransferError::Protocol(format!(
                        "WRITE frame of {len} bytes; frames are {} to {} bytes",
                        protocol::WRITE_FIXED,
                        protocol::MAX_FRAME_BYTES
                    )));
                }
                let mut fixed = [0u8; protocol::WRITE_FIXED];
                reader
                    .read_exact(&mut fixed)
                    .await
                    .map_err(|e| lost(peer, &e))?;
                let mut fixed = &fixed[..];
                let transfer = crate::TransferId(fixed.get_u64_le());
                let count = fixed.get_u32_le() as usize;
                let expected = count
                    .checked_mul(protocol::WRITE_ENTRY + per_block)
                    .and_then(|n| n.checked_add(protocol::WRITE_FIXED));
                if expected != Some(len) {
                    return Err(TransferError::Protocol(format!(
                        "WRITE frame of {len} bytes for {count} blocks; with {per_block} \
                         bytes of K and V per block the layout needs {}",
                        expected.map_or_else(|| "more than fits".to_string(), |n| n.to_string())
                    )));
                }
                table.resize(count * protocol::WRITE_ENTRY, 0);
                reader
                    .read_exact(&mut table)
                    .await
                    .map_err(|e| lost(peer, &e))?;
                core.begin(transfer)?;
                let mut first = 0;
                while first < count {
                    let n = (count - first).min(chunk_blocks);
                    if payload.len() < n * per_block {
                        payload.resize(n * per_block, 0);
                    }
                    let chunk = &mut payload[..n * per_block];
                    reader.read_exact(chunk).await.map_err(|e| lost(peer, &e))?;
                    for j in 0..n {
                        let mut entry = &table[(first + j) * protocol::WRITE_ENTRY..];
                        let layer = entry.get_u32_le();
                        let block = entry.get_u32_le();
                        let (k, v) =
                            chunk[j * per_block..(j + 1) * per_block].split_at(block_layer_bytes);
                        if let Some(done) = core.block(transfer, layer, block, k, v) {
                            send_done(writer, done, peer).await?;
                        }
                    }
                    first += n;
                }
            }
            kind @ (protocol::FRAME_FINISH | protocol::FRAME_ABORT) => {
                if len != 8 {
                    return Err(TransferError::Protocol(format!(
                        "{} frame of {len} bytes; it is 8",
                        if kind == protocol::FRAME_FINISH {
                            "FINISH"
                        } else {
                            "ABORT"
                        }
                    )));
                }
                let mut id = [0u8; 8];
                reader
                    .read_exact(&mut id)
                    .await
                    .map_err(|e| lost(peer, &e))?;
                let transfer = crate::TransferId(u64::from_le_bytes(id));
                if kind == protocol::FRAME_ABORT {
                    core.abort(transfer);
                } else if let Some(done) = core.finish(transfer) {
                    send_done(writer, done, peer).await?;
                }
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "unknown frame type {other:#04x} (length {len})"
                )))
            }
        }
    }
}
