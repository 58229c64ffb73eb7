//! The sending side of a UCX session: batches of blocks into the slots
//! the sender holds credits for (puts and a flush, or as a notice's data),
//! sequenced notices, and the loop that takes acks and credits back.

use super::*;

/// Where the sender puts blocks in the receiver's region.
#[derive(Debug, Clone, Copy)]
pub(super) struct SlotPlan {
    pub(super) conn: u64,
    /// Blocks travel as the notice's data, not as puts.
    pub(super) rendezvous: bool,
    /// The most blocks one notice may name.
    pub(super) max_batch: usize,
    /// The payload bytes a batch aims at.
    pub(super) batch_bytes: usize,
    pub(super) region_addr: u64,
    pub(super) slots: u32,
    pub(super) slot_bytes: usize,
    pub(super) block_layer_bytes: usize,
}

pub(super) struct WriteCtx {
    pub(super) queue: mpsc::Receiver<Command>,
    pub(super) rt: Arc<rt::Runtime>,
    pub(super) ep: rt::EpId,
    pub(super) writer: OwnedWriteHalf,
    pub(super) plan: SlotPlan,
    pub(super) credits: Arc<Semaphore>,
    pub(super) completions: Arc<Completions>,
    pub(super) dead: watch::Receiver<bool>,
}

type Reply = oneshot::Receiver<Result<(), TransferError>>;

/// Waits for `reply` unless the connection dies first.
async fn await_reply(
    reply: Reply,
    dead: &mut watch::Receiver<bool>,
    completions: &Completions,
) -> Result<(), TransferError> {
    tokio::select! {
        biased;
        r = reply => r.map_err(|_| completions.dead_error())?,
        _ = dead.wait_for(|d| *d) => Err(completions.dead_error()),
    }
}

/// One message for the progress thread: its payload, where that lands
/// (first slot, slots; none for puts and control messages) and its body.
struct Message {
    payload: rt::Payload,
    landing: (u32, u32),
    body: Vec<u8>,
}

impl Message {
    fn control(body: Vec<u8>) -> Self {
        Self {
            payload: rt::Payload::Put(Vec::new()),
            landing: (0, 0),
            body,
        }
    }
}

/// `buffers` as one contiguous range: as they are when they lie back to back
/// in memory (a prefill worker exports a layer's blocks in one buffer),
/// else copied into one. A memory copy costs far less than UCX 1.13's
/// rendezvous of a scatter-gather list over tcp (see `rt::Payload::Send`).
pub(super) fn contiguous(buffers: Vec<Bytes>) -> Vec<Bytes> {
    if rt::contiguous_ranges(&buffers).len() <= 1 {
        return buffers;
    }
    let mut one = BytesMut::with_capacity(buffers.iter().map(Bytes::len).sum());
    for b in &buffers {
        one.extend_from_slice(b);
    }
    vec![one.freeze()]
}

/// The sender's writer: turns commands into batches and messages.
pub(super) async fn write_loop(mut ctx: WriteCtx) {
    let plan = ctx.plan;
    let per_batch = batch_slots(
        plan.batch_bytes,
        plan.slot_bytes,
        plan.max_batch,
        plan.slots as usize,
    );
    let mut seq = 0u64;
    let mut cursor = 0u32;
    let mut inflight: VecDeque<Reply> = VecDeque::new();
    let outcome: Result<(), TransferError> = async {
        while let Some(command) = ctx.queue.recv().await {
            let mut messages: Vec<Message> = Vec::new();
            match command {
                Command::Write { transfer, blocks } => {
                    let mut blocks = blocks.into_iter().peekable();
                    while blocks.peek().is_some() {
                        let batch: Vec<BlockWrite> = blocks.by_ref().take(per_batch).collect();
                        let n = batch.len();
                        tokio::select! {
                            biased;
                            permit = ctx.credits.acquire_many(n as u32) => match permit {
                                Ok(p) => p.forget(),
                                Err(_) => return Err(ctx.completions.dead_error()),
                            },
                            _ = ctx.dead.wait_for(|d| *d) => return Err(ctx.completions.dead_error()),
                        }
                        let first = cursor;
                        let mut puts = Vec::with_capacity(2 * n);
                        let mut body = Vec::with_capacity(NOTICE_FIXED + n * NOTICE_ENTRY);
                        body.put_u8(MSG_WRITE);
                        body.put_u64_le(transfer.0);
                        body.put_u32_le(n as u32);
                        for block in batch {
                            body.put_u32_le(block.layer);
                            body.put_u32_le(block.dst_block);
                            body.put_u32_le(cursor);
                            let slot_addr =
                                plan.region_addr + cursor as u64 * plan.slot_bytes as u64;
                            puts.push(rt::Put {
                                bytes: block.k,
                                remote_addr: slot_addr,
                            });
                            // A latent layout has no V.
                            if !block.v.is_empty() {
                                puts.push(rt::Put {
                                    bytes: block.v,
                                    remote_addr: slot_addr + plan.block_layer_bytes as u64,
                                });
                            }
                            cursor = (cursor + 1) % plan.slots;
                        }
                        messages.push(if plan.rendezvous {
                            // The same bytes in the same order, as the data.
                            let buffers = puts.into_iter().map(|p| p.bytes).collect();
                            Message {
                                payload: rt::Payload::Send(contiguous(buffers)),
                                landing: (first, n as u32),
                                body,
                            }
                        } else {
                            Message {
                                payload: rt::Payload::Put(puts),
                                landing: (0, 0),
                                body,
                            }
                        });
                        send_messages(&mut ctx, &mut messages, &mut seq, &mut inflight).await?;
                    }
                }
                Command::Finish(t) => messages.push(Message::control(control_message(MSG_FINISH, t))),
                Command::Abort(t) => messages.push(Message::control(control_message(MSG_ABORT, t))),
            }
            send_messages(&mut ctx, &mut messages, &mut seq, &mut inflight).await?;
        }
        // The session was dropped: let what it wrote go out (bounded), then
        // tell the receiver how many messages to expect before the end.
        tokio::time::timeout(CLOSE_WAIT, async {
            while let Some(reply) = inflight.pop_front() {
                match reply.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err(ctx.completions.dead_error()),
                }
            }
            Ok(())
        })
        .await
        .map_err(|_| timeout_error("sending the last UCX messages", CLOSE_WAIT))??;
        ctx.writer
            .write_all(&seq.to_le_bytes())
            .await
            .map_err(|e| TransferError::io("closing the UCX control connection", &e))
    }
    .await;
    if let Err(e) = outcome {
        ctx.completions.fail_all(e);
    }
    ctx.rt.close(ctx.ep);
    let _ = ctx.writer.shutdown().await;
}

async fn send_messages(
    ctx: &mut WriteCtx,
    messages: &mut Vec<Message>,
    seq: &mut u64,
    inflight: &mut VecDeque<Reply>,
) -> Result<(), TransferError> {
    for message in messages.drain(..) {
        let (first, count) = message.landing;
        let header = rt::am_header(ctx.plan.conn, *seq, first, count, &message.body);
        let reply = ctx.rt.batch(ctx.ep, message.payload, header)?;
        *seq += 1;
        inflight.push_back(reply);
        while inflight.len() > WINDOW {
            if let Some(reply) = inflight.pop_front() {
                await_reply(reply, &mut ctx.dead, &ctx.completions).await?;
            }
        }
        // Reap what already completed, so errors surface early.
        while let Some(front) = inflight.front_mut() {
            match front.try_recv() {
                Ok(result) => {
                    result?;
                    inflight.pop_front();
                }
                Err(oneshot::error::TryRecvError::Empty) => break,
                Err(oneshot::error::TryRecvError::Closed) => {
                    return Err(ctx.completions.dead_error())
                }
            }
        }
    }
    Ok(())
}

/// Reads `DONE`/`CREDIT`/`CLOSE` from the receiver until the control
/// connection ends, then fails everything still pending.
pub(super) async fn ack_loop(
    reader: OwnedReadHalf,
    completions: Arc<Completions>,
    credits: Arc<Semaphore>,
    slots: usize,
    dead: watch::Sender<bool>,
    endpoint: String,
) {
    let mut reader = BufReader::new(reader);
    let max_body = 11 + protocol::MAX_MESSAGE_BYTES;
    let err = loop {
        let (kind, body) = match read_frame(&mut reader, max_body, &endpoint).await {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                break TransferError::ConnectionLost(format!("{endpoint} closed the connection"))
            }
            Err(e) => break e,
        };
        let outcome = match kind {
            protocol::FRAME_DONE => {
                protocol::decode_done(&body).and_then(|done| completions.on_done(done))
            }
            FRAME_CREDIT if body.len() == 4 => {
                let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
                if credits.available_permits() + n > slots {
                    Err(TransferError::Protocol(format!(
                        "{endpoint} returned more slots than it lent"
                    )))
                } else {
                    credits.add_permits(n);
                    Ok(())
                }
            }
            protocol::FRAME_CLOSE => Err(protocol::closed_by_peer(&endpoint, &body)),
            other => Err(TransferError::Protocol(format!(
                "{endpoint} sent an unexpected frame type {other:#04x}"
            ))),
        };
        if let Err(e) = outcome {
            break e;
        }
    };
    completions.fail_all(err);
    credits.close();
    let _ = dead.send(true);
}
