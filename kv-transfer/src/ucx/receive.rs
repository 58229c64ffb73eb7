//! The receiving side of a UCX session: one task per control connection
//! (handshake, offer of a registered receive ring), and `Receiver`, which
//! applies notices in sequence order, copies each block from its slot into
//! the sink and returns the slots.

use super::*;

/// What every connection of one listener needs.
pub(super) struct ListenCtx {
    pub(super) layout: KvLayoutDescriptor,
    pub(super) sink: Arc<dyn KvSink>,
    pub(super) config: Arc<UcxConfig>,
    pub(super) rt: Arc<rt::Runtime>,
    pub(super) slots: u32,
    pub(super) slot_bytes: usize,
    pub(super) next_conn: AtomicU64,
    pub(super) counters: Arc<TransferCounters>,
}

fn report(ctx: &ListenCtx, peer: &str, err: &TransferError) {
    tracing::warn!(%peer, error = %err, "UCX KV transfer connection refused or failed");
    ctx.sink.peer_error(peer, err);
}

/// Removes a connection's route when dropped.
struct RouteGuard {
    rt: Arc<rt::Runtime>,
    conn: u64,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.rt
            .routes()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.conn);
    }
}

pub(super) async fn serve_connection(stream: TcpStream, peer: String, ctx: Arc<ListenCtx>) {
    let _ = stream.set_nodelay(true);
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader);
    let limit = ctx.config.tcp.handshake_timeout;
    let handshake = tokio::time::timeout(
        limit,
        server_handshake(
            protocol::MAGIC_UCX,
            &mut reader,
            &mut writer,
            &ctx.layout,
            &ctx.config.tcp,
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
    // The region and its rkey exist only for a peer that proved the
    // cluster secret: nobody else can address an RMA put to this pool.
    let region = match rt::Region::new(
        ctx.rt.context().clone(),
        ctx.slots as usize * ctx.slot_bytes,
    )
    .and_then(|r| r.pack_rkey().map(|k| (r, k)))
    {
        Ok(r) => r,
        Err(e) => {
            report(&ctx, &peer, &e);
            let close = protocol::encode_close(&e.to_string());
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&close)).await;
            return;
        }
    };
    let (region, rkey) = region;
    let region = Arc::new(region);
    let (conn, mut messages, _route) = open_route(&ctx, &region);
    let offer = encode_offer(&Offer {
        conn,
        region_addr: region.remote_addr(),
        slot_bytes: ctx.slot_bytes as u32,
        slots: ctx.slots,
        worker: ctx.rt.address().to_vec(),
        rkey,
    });
    if let Err(e) = writer.write_all(&offer).await {
        report(&ctx, &peer, &TransferError::io("sending the UCX offer", &e));
        return;
    }
    let mut rx = Receiver {
        core: ReceiverCore::new(ctx.sink.clone(), &ctx.layout, ctx.counters.clone()),
        region: &region,
        ctx: &ctx,
        next_seq: 0,
        pending: BTreeMap::new(),
    };
    let result = receive(&mut rx, &mut messages, &mut reader, &mut writer, &peer).await;
    match result {
        Ok(()) => rx
            .core
            .close("the sender closed the connection with the transfer open"),
        Err(e) => {
            let message = e.to_string();
            rx.core.close(&message);
            report(&ctx, &peer, &e);
            let close = protocol::encode_close(&message);
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&close)).await;
            // Keep the region mapped until the sender has stopped (closed
            // its side), within a bound.
            let _ = tokio::time::timeout(CLOSE_WAIT, async {
                let mut sink = [0u8; 256];
                while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        }
    }
    drop(rx);
    drop(region);
}

/// Routes the UCX worker's active messages for a new connection number to
/// this connection's queue, until the guard drops.
fn open_route(
    ctx: &Arc<ListenCtx>,
    region: &Arc<rt::Region>,
) -> (u64, mpsc::Receiver<rt::AmMsg>, RouteGuard) {
    let conn = ctx.next_conn.fetch_add(1, Ordering::Relaxed);
    let (tx, messages) = mpsc::channel(MESSAGE_QUEUE);
    ctx.rt
        .routes()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(
            conn,
            rt::Route {
                queue: tx,
                region: region.clone(),
                slot_bytes: ctx.slot_bytes,
                slots: ctx.slots,
            },
        );
    let guard = RouteGuard {
        rt: ctx.rt.clone(),
        conn,
    };
    (conn, messages, guard)
}

/// Applies the sender's messages until it says goodbye on the control
/// connection (the number of messages it sent, so the ones still in flight
/// are applied first) or is gone.
async fn receive(
    rx: &mut Receiver<'_>,
    messages: &mut mpsc::Receiver<rt::AmMsg>,
    reader: &mut BufReader<OwnedReadHalf>,
    writer: &mut OwnedWriteHalf,
    peer: &str,
) -> Result<(), TransferError> {
    let mut tail = [0u8; 9];
    let mut got = 0;
    let total = loop {
        tokio::select! {
            msg = messages.recv() => match msg {
                Some(msg) => rx.accept(msg, writer, peer).await?,
                None => return Err(overrun()),
            },
            read = reader.read(&mut tail[got..]) => match read {
                Ok(0) if got == 8 => {
                    let mut n = [0u8; 8];
                    n.copy_from_slice(&tail[..8]);
                    break u64::from_le_bytes(n);
                }
                // Gone without a goodbye (killed): fail what is open now.
                Ok(0) if got == 0 => return Ok(()),
                Ok(0) => return Err(TransferError::Protocol(
                    "truncated goodbye on the control connection".into(),
                )),
                Ok(n) if got + n <= 8 => got += n,
                Ok(_) => return Err(TransferError::Protocol(
                    "unexpected bytes from the sender on the control connection".into(),
                )),
                Err(e) => return Err(lost(peer, &e)),
            },
        }
    };
    tokio::time::timeout(CLOSE_WAIT, async {
        while rx.next_seq < total {
            match messages.recv().await {
                Some(msg) => rx.accept(msg, writer, peer).await?,
                None => return Err(overrun()),
            }
        }
        Ok(())
    })
    .await
    .map_err(|_| timeout_error("waiting for the sender's last messages", CLOSE_WAIT))?
}

fn overrun() -> TransferError {
    TransferError::Protocol(
        "the sender overran its message queue or sent data that does not fit the slots it named"
            .into(),
    )
}

/// The receiving side of one connection: in-order messages into the core.
struct Receiver<'a> {
    core: ReceiverCore,
    region: &'a rt::Region,
    ctx: &'a ListenCtx,
    next_seq: u64,
    pending: BTreeMap<u64, Vec<u8>>,
}

impl Receiver<'_> {
    async fn accept(
        &mut self,
        msg: rt::AmMsg,
        writer: &mut OwnedWriteHalf,
        peer: &str,
    ) -> Result<(), TransferError> {
        if msg.seq < self.next_seq || self.pending.contains_key(&msg.seq) {
            return Err(TransferError::Protocol(format!(
                "message {} arrived twice",
                msg.seq
            )));
        }
        if self.pending.len() >= MESSAGE_QUEUE {
            return Err(TransferError::Protocol(
                "too many messages out of order".into(),
            ));
        }
        self.pending.insert(msg.seq, msg.body);
        while let Some(body) = self.pending.remove(&self.next_seq) {
            self.next_seq += 1;
            self.handle(&body, writer, peer).await?;
        }
        Ok(())
    }

    async fn handle(
        &mut self,
        body: &[u8],
        writer: &mut OwnedWriteHalf,
        peer: &str,
    ) -> Result<(), TransferError> {
        let mut b = body;
        if b.len() < 9 {
            return Err(TransferError::Protocol(format!(
                "message of {} bytes",
                body.len()
            )));
        }
        let kind = b.get_u8();
        let transfer = TransferId(b.get_u64_le());
        match kind {
            MSG_WRITE => {
                if b.len() < 4 {
                    return Err(TransferError::Protocol("truncated WRITE notice".into()));
                }
                let count = b.get_u32_le() as usize;
                if count > MAX_NOTICE_BLOCKS || b.len() != count * NOTICE_ENTRY {
                    return Err(TransferError::Protocol(format!(
                        "WRITE notice for {count} blocks with {} bytes of entries",
                        b.len()
                    )));
                }
                self.core.begin(transfer)?;
                let half = self.ctx.layout.block_layer_bytes();
                let v_bytes = self.ctx.layout.value_bytes();
                for _ in 0..count {
                    let (layer, block, slot) = (b.get_u32_le(), b.get_u32_le(), b.get_u32_le());
                    if slot >= self.ctx.slots {
                        return Err(TransferError::Protocol(format!(
                            "slot {slot} out of range: the region has {}",
                            self.ctx.slots
                        )));
                    }
                    let at = slot as usize * self.ctx.slot_bytes;
                    let (Some(k), Some(v)) = (
                        self.region.read(at, half),
                        self.region.read(at + half, v_bytes),
                    ) else {
                        return Err(TransferError::Protocol(format!("slot {slot} out of range")));
                    };
                    if let Some(done) = self.core.block(transfer, layer, block, k, v) {
                        send_done(writer, done, peer).await?;
                    }
                }
                let mut credit = Vec::with_capacity(protocol::FRAME_HEADER + 4);
                credit.put_u8(FRAME_CREDIT);
                credit.put_u32_le(4);
                credit.put_u32_le(count as u32);
                writer.write_all(&credit).await.map_err(|e| {
                    TransferError::ConnectionLost(format!("returning slots to {peer}: {e}"))
                })?;
            }
            MSG_FINISH | MSG_ABORT if b.is_empty() => {
                if kind == MSG_ABORT {
                    self.core.abort(transfer);
                } else if let Some(done) = self.core.finish(transfer) {
                    send_done(writer, done, peer).await?;
                }
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "unknown message type {other} ({} bytes)",
                    body.len()
                )))
            }
        }
        Ok(())
    }
}
