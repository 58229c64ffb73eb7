//! The UCX worker, owned by its progress thread: endpoints, active-message
//! receive, batches in flight. Only this thread touches UCX objects.

mod datapath;

use super::*;

/// Status cell an endpoint's error callback writes (`UCS_OK` while healthy).
#[derive(Debug, Default)]
struct EpStatus(AtomicI8);

struct EpEntry {
    ep: sys::ucp_ep_h,
    rkey: sys::ucp_rkey_h,
    /// Opened with `UCP_ERR_HANDLING_MODE_PEER`: only such an endpoint may
    /// be force-closed (UCX leaves a force close without peer error
    /// handling undefined; 1.13 aborts on the peer's late wireup reply).
    peer_errors: bool,
    /// Boxed so its address, given to UCX as the error handler's argument,
    /// is stable.
    status: Box<EpStatus>,
}

enum Stage {
    Flushing(*mut c_void),
    Sending(*mut c_void),
}

/// A batch between its puts and its active message's completion. Owns the
/// buffers UCX reads from until then. UCX holds pointers into the heap
/// buffers of `header`, `iov` and the payload, which do not move when the
/// flight does (into and within `Worker::flights`).
struct Flight {
    ep: EpId,
    stage: Stage,
    payload: Payload,
    /// The scatter-gather list of a `Payload::Send`, built when it is sent.
    iov: Vec<sys::ucp_dt_iov_t>,
    header: Vec<u8>,
    reply: oneshot::Sender<Result<(), TransferError>>,
}

/// A rendezvous payload being received into a connection's region.
struct Receive {
    req: *mut c_void,
    conn: u64,
    /// Delivered to the connection once the payload has landed.
    msg: AmMsg,
    /// UCX writes through these until the receive completes.
    _iov: Vec<sys::ucp_dt_iov_t>,
    /// Keeps the region mapped until then.
    _region: Arc<Region>,
}

/// What the active-message handler works with: the routes, the worker (to
/// start rendezvous receives) and the receives in progress. Lives on the
/// progress thread only (`Rc`, `RefCell`), as the handler runs inside
/// `ucp_worker_progress` there.
struct AmState {
    routes: Arc<Routes>,
    worker: Cell<sys::ucp_worker_h>,
    receives: RefCell<Vec<Receive>>,
}

pub(super) struct Worker {
    raw: sys::ucp_worker_h,
    efd: i32,
    pub(super) address: Vec<u8>,
    pub(super) max_am_header: usize,
    /// Kept alive for the AM handler's `arg` pointer.
    am: Rc<AmState>,
    eps: HashMap<EpId, EpEntry>,
    next_ep: u64,
    flights: Vec<Flight>,
    closing: Vec<*mut c_void>,
    /// Whether to ask for `UCP_ERR_HANDLING_MODE_PEER` (see `connect`).
    peer_failure_handling: bool,
    /// Error cells of closed endpoints (see `close`); boxed because UCX
    /// holds their addresses, which must not move when the Vec grows.
    #[allow(clippy::vec_box)]
    retired: Vec<Box<EpStatus>>,
    /// Owns the worker's context reference: the context is cleaned up
    /// after the worker is destroyed.
    _ctx: Arc<Context>,
}

/// Hands `msg` to connection `conn`'s queue; a full queue (the peer outran
/// its credits) or a closed one fails the connection (drops its route).
fn deliver(routes: &mut HashMap<u64, Route>, conn: u64, msg: AmMsg) {
    if let Some(route) = routes.get(&conn) {
        if route.queue.try_send(msg).is_err() {
            routes.remove(&conn);
        }
    }
}

/// Where a payload went.
enum Landing {
    /// In the region already.
    Done,
    /// Being received (rendezvous).
    Pending(*mut c_void, Vec<sys::ucp_dt_iov_t>),
}

/// Lands a message's payload (`length` bytes at `data`, or the rendezvous
/// descriptor `data`) in `count` slots of `route`'s region from `first`.
/// An error fails the connection.
///
/// # Safety
/// `data` and `length` as UCX passed them to the handler, which is running;
/// `worker` is the worker the handler runs on.
unsafe fn land(
    worker: sys::ucp_worker_h,
    route: &Route,
    data: *mut c_void,
    length: usize,
    rndv: bool,
    first: u32,
    count: u32,
) -> Result<Landing, ()> {
    let ranges = route.landing(first, count, length).ok_or(())?;
    if !rndv {
        if data.is_null() {
            return Err(());
        }
        // SAFETY: eager data: `length` readable bytes at `data` for the
        // handler's duration (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) };
        let mut at = 0;
        for (offset, len) in ranges {
            if !route.region.write(offset, &bytes[at..at + len]) {
                return Err(());
            }
            at += len;
        }
        return Ok(Landing::Done);
    }
    let mut iov = Vec::with_capacity(ranges.len());
    for (offset, len) in ranges {
        let buffer = route.region.range_ptr(offset, len).ok_or(())?;
        iov.push(sys::ucp_dt_iov_t {
            buffer: buffer.cast(),
            length: len,
        });
    }
    // One range (the ring did not wrap) is received as a contiguous buffer.
    let (buffer, count, param) = match iov.as_slice() {
        [one] => (one.buffer, one.length, request_param(0)),
        many => (many.as_ptr().cast_mut().cast(), many.len(), iov_param()),
    };
    // SAFETY: `data` is a rendezvous descriptor UCX handed to the running
    // handler (received once, here); the buffer or list points into the
    // mapped region, and both the list (moved into the `Receive`, its heap
    // buffer does not move) and the region (an `Arc` in the `Receive`) live
    // until the request completes.
    let ptr = unsafe { sys::ucp_am_recv_data_nbx(worker, data, buffer, count, &param) };
    match started(ptr, "receive") {
        Ok(Started::Done) => Ok(Landing::Done),
        Ok(Started::Pending(req)) => Ok(Landing::Pending(req, iov)),
        Err(_) => Err(()),
    }
}

/// The active-message handler: lands the payload, if any, in the
/// connection's region, then (for a rendezvous, once received) queues the
/// message for the connection; drops messages for unknown (closed)
/// connections.
unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is `Rc::as_ptr` of the worker's `AmState`, alive as long
    // as the worker, whose progress (on this thread) is the only caller.
    let state = unsafe { &*arg.cast::<AmState>() };
    if header_length < AM_HEADER || header.is_null() {
        return sys::ucs_status_t::UCS_OK;
    }
    // SAFETY: UCX passes `header_length` readable bytes at `header`.
    let header = unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) };
    let Some((conn, seq, first, count)) = parse_am_header(header) else {
        return sys::ucs_status_t::UCS_OK;
    };
    // SAFETY: `param` is valid for the callback's duration.
    let rndv = unsafe { param.as_ref() }
        .is_some_and(|p| p.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
    let msg = AmMsg {
        seq,
        body: header[AM_HEADER..].to_vec(),
    };
    let mut routes = state.routes.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(route) = routes.get(&conn) else {
        return sys::ucs_status_t::UCS_OK;
    };
    if length == 0 && !rndv {
        deliver(&mut routes, conn, msg);
        return sys::ucs_status_t::UCS_OK;
    }
    // SAFETY: `data`/`length` as UCX passed them; the worker runs this.
    match unsafe { land(state.worker.get(), route, data, length, rndv, first, count) } {
        Ok(Landing::Done) => deliver(&mut routes, conn, msg),
        Ok(Landing::Pending(req, iov)) => state.receives.borrow_mut().push(Receive {
            req,
            conn,
            msg,
            _iov: iov,
            _region: route.region.clone(),
        }),
        // A payload that does not fit the slots it names breaks the
        // protocol: dropping the route fails the connection at its task.
        Err(()) => {
            routes.remove(&conn);
        }
    }
    sys::ucs_status_t::UCS_OK
}

/// An endpoint's error callback: records the failure.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` points to the entry's boxed `EpStatus`, which lives until
    // the endpoint is closed.
    let cell = unsafe { &*arg.cast::<EpStatus>() };
    cell.0.store(status.0, Ordering::Release);
}

/// Whether the transports UCX chose for `ep` do RMA natively. UCX 1.13 has
/// no query for it; the endpoint's configuration, as `ucp_ep_print_info`
/// writes it, lists one `put[i]` protocol line per RMA lane, and none where
/// UCX emulates RMA over active messages (`tcp`). Unknown (the text cannot
/// be captured) counts as no: the active-message data path works on every
/// transport.
fn native_rma(ep: sys::ucp_ep_h) -> bool {
    let mut buf: *mut libc::c_char = ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: valid out-pointers; the stream and its buffer are released
    // below, once.
    let stream = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if stream.is_null() {
        return false;
    }
    // SAFETY: valid endpoint and an open stream, closed right after, which
    // makes `buf`/`size` valid; `buf` is freed once, after copying.
    let text = unsafe {
        sys::ucp_ep_print_info(ep, stream.cast());
        libc::fclose(stream);
        let text = if buf.is_null() {
            String::new()
        } else {
            String::from_utf8_lossy(std::slice::from_raw_parts(buf.cast::<u8>(), size)).into_owned()
        };
        libc::free(buf.cast());
        text
    };
    text.lines()
        .any(|l| l.trim_start_matches('#').trim_start().starts_with("put["))
}

/// Parameters for a scatter-gather (`UCP_DATATYPE_IOV`) buffer.
fn iov_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_DATATYPE,
        datatype: sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV),
        ..Default::default()
    }
}

fn request_param(flags: u32) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: if flags != 0 {
            sys::UCP_OP_ATTR_FIELD_FLAGS
        } else {
            0
        },
        flags,
        ..Default::default()
    }
}

/// What a `*_nbx` call returned: done, failed, or a request to poll.
enum Started {
    Done,
    Pending(*mut c_void),
}

fn started(ptr: sys::ucs_status_ptr_t, what: &str) -> Result<Started, TransferError> {
    let ptr = ptr.cast::<c_void>();
    if ptr.is_null() {
        Ok(Started::Done)
    } else if sys::ucs_ptr_is_err(ptr) {
        Err(TransferError::ConnectionLost(format!(
            "UCX {what}: {}",
            status_str(sys::ucs_ptr_raw_status(ptr))
        )))
    } else {
        Ok(Started::Pending(ptr))
    }
}

impl Worker {
    pub(super) fn new(ctx: Arc<Context>, routes: Arc<Routes>) -> Result<Self, TransferError> {
        let am = Rc::new(AmState {
            routes,
            worker: Cell::new(ptr::null_mut()),
            receives: RefCell::default(),
        });
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: valid context, params and out-pointer.
        check(
            unsafe { sys::ucp_worker_create(ctx.raw, &params, &mut raw) },
            "creating the worker (ucp_worker_create)",
        )?;
        // From here on, `worker`'s Drop destroys `raw`.
        let mut worker = Self {
            raw,
            efd: -1,
            address: Vec::new(),
            max_am_header: 0,
            am,
            eps: HashMap::new(),
            next_ep: 0,
            flights: Vec::new(),
            closing: Vec::new(),
            peer_failure_handling: true,
            retired: Vec::new(),
            _ctx: ctx,
        };
        let mut efd = -1;
        // SAFETY: valid worker (created with WAKEUP) and out-pointer.
        check(
            unsafe { sys::ucp_worker_get_efd(worker.raw, &mut efd) },
            "getting the worker's event fd",
        )?;
        worker.efd = efd;
        worker.am.worker.set(worker.raw);
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: valid worker and out-struct.
        check(
            unsafe { sys::ucp_worker_query(worker.raw, &mut attr) },
            "querying the worker (ucp_worker_query)",
        )?;
        worker.max_am_header = attr.max_am_header;
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: valid worker and out-pointers; the address is copied and
        // released once.
        unsafe {
            check(
                sys::ucp_worker_get_address(worker.raw, &mut addr, &mut len),
                "getting the worker's address",
            )?;
            worker.address = std::slice::from_raw_parts(addr.cast::<u8>(), len).to_vec();
            sys::ucp_worker_release_address(worker.raw, addr);
        }
        let handler = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_am),
            arg: Rc::as_ptr(&worker.am).cast_mut().cast(),
        };
        // SAFETY: valid worker; `arg` stays valid while the worker lives
        // (the worker holds the Rc).
        check(
            unsafe { sys::ucp_worker_set_am_recv_handler(worker.raw, &handler) },
            "setting the active-message handler",
        )?;
        Ok(worker)
    }

    /// Opens an endpoint asking UCX to report peer failures; where the
    /// transports cannot (UCX 1.13's shared memory when connecting by worker
    /// address), one without, and the worker remembers that so UCX logs its
    /// refusal once, not per connection. Either way the control connection
    /// is how a dead peer is noticed.
    fn connect(&mut self, address: &[u8], rkey: &[u8]) -> Result<Connected, TransferError> {
        let ep = self.connect_ep(address, rkey)?;
        let native_rma = self.eps.get(&ep).is_some_and(|e| native_rma(e.ep));
        Ok(Connected { ep, native_rma })
    }

    fn connect_ep(&mut self, address: &[u8], rkey: &[u8]) -> Result<EpId, TransferError> {
        if self.peer_failure_handling {
            match self.connect_with(address, rkey, sys::UCP_ERR_HANDLING_MODE_PEER) {
                Err(TransferError::Config(first)) => {
                    tracing::info!(
                        error = %first,
                        "UCX: these transports cannot report peer failures; connecting without"
                    );
                    self.peer_failure_handling = false;
                }
                other => return other,
            }
        }
        self.connect_with(address, rkey, sys::UCP_ERR_HANDLING_MODE_NONE)
    }

    fn connect_with(
        &mut self,
        address: &[u8],
        rkey: &[u8],
        err_mode: sys::ucp_err_handling_mode_t,
    ) -> Result<EpId, TransferError> {
        let status = Box::<EpStatus>::default();
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr().cast(),
            err_mode,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: ptr::from_ref::<EpStatus>(&status).cast_mut().cast(),
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: valid worker; `address` is the peer's packed worker address
        // (UCX validates it); the error handler's arg outlives the endpoint
        // (it is dropped only after the endpoint is closed).
        check(
            unsafe { sys::ucp_ep_create(self.raw, &params, &mut ep) },
            "connecting to the peer (ucp_ep_create)",
        )?;
        let mut key: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: valid endpoint, buffer and out-pointer.
        let unpacked = unsafe { sys::ucp_ep_rkey_unpack(ep, rkey.as_ptr().cast(), &mut key) };
        let id = EpId(self.next_ep);
        self.next_ep += 1;
        self.eps.insert(
            id,
            EpEntry {
                ep,
                rkey: if unpacked == sys::ucs_status_t::UCS_OK {
                    key
                } else {
                    ptr::null_mut()
                },
                peer_errors: err_mode == sys::UCP_ERR_HANDLING_MODE_PEER,
                status,
            },
        );
        if let Err(e) = check(unpacked, "unpacking the peer's remote key") {
            self.close(id);
            return Err(e);
        }
        Ok(id)
    }

    fn ep_error(&self, id: EpId) -> Option<TransferError> {
        let Some(entry) = self.eps.get(&id) else {
            return Some(TransferError::ConnectionLost(
                "the UCX endpoint is closed".into(),
            ));
        };
        let status = sys::ucs_status_t(entry.status.0.load(Ordering::Acquire));
        (status != sys::ucs_status_t::UCS_OK).then(|| {
            TransferError::ConnectionLost(format!("UCX endpoint failed: {}", status_str(status)))
        })
    }

    fn close(&mut self, id: EpId) {
        let Some(entry) = self.eps.remove(&id) else {
            return;
        };
        let mut param = request_param(0);
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        // Without peer error handling a close must flush (it completes once
        // wireup and outstanding operations have).
        param.flags = if entry.peer_errors {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        // SAFETY: the rkey belongs to this endpoint and is destroyed before
        // it; the endpoint is closed once. Flights on it complete with an
        // error during the close and are reaped by `poll_flights`.
        let ptr = unsafe {
            if !entry.rkey.is_null() {
                sys::ucp_rkey_destroy(entry.rkey);
            }
            sys::ucp_ep_close_nbx(entry.ep, &param)
        };
        if let Ok(Started::Pending(req)) = started(ptr, "close") {
            self.closing.push(req);
        }
        // The error cell may still be written by UCX until the close
        // request completes; keep it until the worker is gone.
        self.retired.push(entry.status);
    }

    fn handle(&mut self, op: Op) {
        match op {
            Op::Connect {
                address,
                rkey,
                reply,
            } => {
                let _ = reply.send(self.connect(&address, &rkey));
            }
            Op::Batch {
                ep,
                payload,
                header,
                reply,
            } => self.start_batch(ep, payload, header, reply),
            Op::Close(ep) => self.close(ep),
        }
    }

    /// The progress loop, until the runtime is dropped.
    pub(super) fn run(mut self, queue: std_mpsc::Receiver<Op>, wake: &OwnedFd) {
        let mut idle = 0u32;
        let mut open = true;
        while open {
            let mut busy = false;
            loop {
                match queue.try_recv() {
                    Ok(op) => {
                        busy = true;
                        self.handle(op);
                    }
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            // SAFETY: the worker is used on this thread only.
            while unsafe { sys::ucp_worker_progress(self.raw) } != 0 {
                busy = true;
            }
            busy |= self.poll_flights();
            busy |= self.poll_receives();
            if busy {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_SPINS {
                continue;
            }
            idle = 0;
            // Sleep until UCX or a command wakes us: briefly while
            // operations are pending (in case a transport signals no
            // event for them), long when idle.
            let timeout_ms = if self.flights.is_empty()
                && self.closing.is_empty()
                && self.am.receives.borrow().is_empty()
            {
                100
            } else {
                1
            };
            // SAFETY: valid worker on its own thread.
            if unsafe { sys::ucp_worker_arm(self.raw) } == sys::ucs_status_t::UCS_OK {
                let mut fds = [
                    libc::pollfd {
                        fd: self.efd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: wake.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: two valid pollfds; the timeout bounds the sleep even
                // if a transport signals no event.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
                let mut counter = [0u8; 8];
                // SAFETY: draining our non-blocking eventfd into a local.
                unsafe { libc::read(wake.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
            }
        }
        self.shutdown();
    }

    /// Closes every endpoint and gives their requests a bounded time.
    fn shutdown(&mut self) {
        let ids: Vec<EpId> = self.eps.keys().copied().collect();
        for id in ids {
            self.close(id);
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        while (!self.closing.is_empty()
            || !self.flights.is_empty()
            || !self.am.receives.borrow().is_empty())
            && Instant::now() < deadline
        {
            // SAFETY: the worker is used on this thread only.
            unsafe { sys::ucp_worker_progress(self.raw) };
            self.poll_flights();
            self.poll_receives();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let flights = std::mem::take(&mut self.flights);
        // SAFETY: destroys the worker once, on its thread, after its
        // endpoints were closed (`shutdown`); requests still pending die
        // with it. Only then are the buffers they referenced (owned by
        // `flights`) dropped. The context outlives it (`self._ctx`).
        unsafe { sys::ucp_worker_destroy(self.raw) };
        // Receives still pending died with the worker: only now may their
        // regions be unmapped.
        self.am.receives.borrow_mut().clear();
        for flight in flights {
            let _ = flight.reply.send(Err(TransferError::ConnectionLost(
                "the UCX transport was shut down".into(),
            )));
        }
    }
}
