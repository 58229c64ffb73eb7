//! The worker's data path: a batch started as puts and a flush or as one
//! active message, the notice that follows it, and the polling of both
//! and of rendezvous receives.

use super::*;

impl Worker {
    /// Starts a batch: its puts and the flush, or its message with data.
    pub(super) fn start_batch(
        &mut self,
        id: EpId,
        payload: Payload,
        header: Vec<u8>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    ) {
        if let Some(e) = self.ep_error(id) {
            let _ = reply.send(Err(e));
            return;
        }
        let Some(entry) = self.eps.get(&id) else {
            return;
        };
        let (ep, rkey) = (entry.ep, entry.rkey);
        let param = request_param(0);
        let mut flushing = None;
        if let Payload::Put(puts) = &payload {
            for (start, len, remote_addr) in merged_puts(puts) {
                // SAFETY: valid endpoint and rkey; the range lies inside the
                // puts' buffers (adjacent ones only are merged), which stay
                // alive in the flight until the flush below completes, which
                // covers this put.
                let ptr =
                    unsafe { sys::ucp_put_nbx(ep, start.cast(), len, remote_addr, rkey, &param) };
                match started(ptr, "put") {
                    Ok(Started::Done) => {}
                    // SAFETY: freeing a pending send request is allowed; UCX
                    // releases it on completion and the flush reports errors.
                    Ok(Started::Pending(req)) => unsafe { sys::ucp_request_free(req) },
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                }
            }
            if !puts.is_empty() {
                // SAFETY: valid endpoint and param.
                match started(unsafe { sys::ucp_ep_flush_nbx(ep, &param) }, "flush") {
                    Ok(Started::Done) => {}
                    Ok(Started::Pending(req)) => flushing = Some(req),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                }
            }
        }
        let flight = Flight {
            ep: id,
            stage: Stage::Flushing(flushing.unwrap_or(ptr::null_mut())),
            payload,
            iov: Vec::new(),
            header,
            reply,
        };
        if flushing.is_some() {
            self.flights.push(flight);
        } else {
            self.send_notice(flight);
        }
    }

    /// Sends a flight's active message: after its puts were flushed, or
    /// with its data.
    fn send_notice(&mut self, mut flight: Flight) {
        let Some(entry) = self.eps.get(&flight.ep) else {
            let _ = flight.reply.send(Err(TransferError::ConnectionLost(
                "the UCX endpoint is closed".into(),
            )));
            return;
        };
        let ep = entry.ep;
        if let Payload::Send(buffers) = &flight.payload {
            flight.iov = contiguous_ranges(buffers)
                .into_iter()
                .map(|(start, length)| sys::ucp_dt_iov_t {
                    buffer: start.cast_mut().cast(),
                    length,
                })
                .collect();
        }
        // UCX picks eager or rendezvous by size for data; a message with
        // only the header is small and always eager.
        let (data, count, param) = match flight.iov.as_slice() {
            [] => (ptr::null(), 0, request_param(sys::UCP_AM_SEND_FLAG_EAGER)),
            [one] => (one.buffer.cast_const(), one.length, request_param(0)),
            many => (many.as_ptr().cast(), many.len(), iov_param()),
        };
        // SAFETY: valid endpoint; the header, the scatter-gather list and
        // the buffers it points to (merged ranges lie inside buffers the
        // payload owns: adjacent ones only) live on the heap, owned by the
        // flight until the send completes (UCX only reads them).
        let ptr = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_ID,
                flight.header.as_ptr().cast(),
                flight.header.len(),
                data,
                count,
                &param,
            )
        };
        match started(ptr, "active message") {
            Ok(Started::Done) => {
                let _ = flight.reply.send(Ok(()));
            }
            Ok(Started::Pending(req)) => {
                flight.stage = Stage::Sending(req);
                self.flights.push(flight);
            }
            Err(e) => {
                let _ = flight.reply.send(Err(e));
            }
        }
    }

    /// Delivers the messages whose payload's rendezvous receive completed
    /// (or fails their connections); returns whether any did.
    pub(super) fn poll_receives(&mut self) -> bool {
        let receives = std::mem::take(&mut *self.am.receives.borrow_mut());
        let mut pending = Vec::with_capacity(receives.len());
        let mut progressed = false;
        for r in receives {
            // SAFETY: `r.req` is a live request we have not freed yet.
            let status = unsafe { sys::ucp_request_check_status(r.req) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                pending.push(r);
                continue;
            }
            progressed = true;
            // SAFETY: completed request, freed once; UCX no longer writes
            // through the list or into the region for it.
            unsafe { sys::ucp_request_free(r.req) };
            let mut routes = self
                .am
                .routes
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if status == sys::ucs_status_t::UCS_OK {
                deliver(&mut routes, r.conn, r.msg);
            } else {
                routes.remove(&r.conn);
            }
        }
        // No handler ran meanwhile (nothing here progresses the worker),
        // but keep anything one might have added, after the older ones.
        let mut cell = self.am.receives.borrow_mut();
        pending.append(&mut cell);
        *cell = pending;
        progressed
    }

    /// Advances every flight whose request completed; returns whether any did.
    pub(super) fn poll_flights(&mut self) -> bool {
        let mut progressed = false;
        let mut i = 0;
        while i < self.flights.len() {
            let req = match self.flights[i].stage {
                Stage::Flushing(r) | Stage::Sending(r) => r,
            };
            // SAFETY: `req` is a live request we have not freed yet.
            let status = unsafe { sys::ucp_request_check_status(req) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            progressed = true;
            // SAFETY: completed request, freed once.
            unsafe { sys::ucp_request_free(req) };
            let flight = self.flights.swap_remove(i);
            if status != sys::ucs_status_t::UCS_OK {
                let _ = flight.reply.send(Err(TransferError::ConnectionLost(format!(
                    "UCX transfer failed: {}",
                    status_str(status)
                ))));
                continue;
            }
            match flight.stage {
                Stage::Flushing(_) => self.send_notice(flight),
                Stage::Sending(_) => {
                    let _ = flight.reply.send(Ok(()));
                }
            }
        }
        self.closing.retain(|&req| {
            // SAFETY: live close request, freed once when done.
            unsafe {
                if sys::ucp_request_check_status(req) == sys::ucs_status_t::UCS_INPROGRESS {
                    true
                } else {
                    sys::ucp_request_free(req);
                    false
                }
            }
        });
        progressed
    }
}
