//! The accept side of every gRPC server: a bounded number of connections,
//! and none that stays silent.
//!
//! tonic serves whatever its incoming stream yields, without a limit, and
//! a TCP connection that never sends the HTTP/2 preface is held for ever
//! (keep-alive pings start only after the handshake). [`capped`] wraps the
//! listener: at most `max` connections are open at once (one more is
//! closed at accept: the client sees it at once and may retry, instead of
//! hanging in the backlog), and a connection that sends no byte within
//! [`FIRST_BYTE_TIMEOUT`] of its accept fails, freeing its slot. Over TLS
//! the handshake has its own limit (`LoadedTls::server`), after which the
//! HTTP/2 keep-alive takes over.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Connections one gRPC listener serves at once by default. Clients and
/// routers multiplex their calls over a few HTTP/2 connections each, so
/// this is far above what a healthy cluster opens, and it bounds a flood.
pub const MAX_GRPC_CONNECTIONS: usize = 4096;

/// A connection that has sent nothing this long after its accept is closed.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(10);

/// One accepted connection holding a slot of its listener.
#[derive(Debug)]
pub struct CappedStream {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    /// Until the peer's first byte: when it fires first, reads fail.
    silent_until: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl AsyncRead for CappedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some(deadline) = this.silent_until.as_mut() {
            match &polled {
                Poll::Ready(Ok(())) if buf.filled().len() > before => this.silent_until = None,
                Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer sent nothing after connecting",
                    )));
                }
                _ => {}
            }
        }
        polled
    }
}

impl AsyncWrite for CappedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Connected for CappedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// `listener`'s connections, at most `max` open at once, each failing if it
/// sends nothing for `first_byte_timeout` (see the module doc; servers use
/// [`FIRST_BYTE_TIMEOUT`]).
pub fn capped(
    listener: TcpListener,
    max: usize,
    first_byte_timeout: Duration,
) -> impl Stream<Item = io::Result<CappedStream>> + Send {
    let slots = Arc::new(Semaphore::new(max));
    futures_util::stream::unfold((listener, slots), move |(listener, slots)| async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off a
                    // little rather than spin (tonic skips the error).
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return Some((Err(e), (listener, slots)));
                }
            };
            // Token deltas are small writes: without this, Nagle holds one
            // back until the peer's (delayed) ACK of the last, up to 40 ms.
            let _ = stream.set_nodelay(true);
            match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    let connection = CappedStream {
                        stream,
                        _slot: slot,
                        silent_until: Some(Box::pin(tokio::time::sleep(first_byte_timeout))),
                    };
                    return Some((Ok(connection), (listener, slots)));
                }
                Err(_) => {
                    tracing::warn!(%peer, max, "gRPC listener at its connection limit; closing a new connection");
                    drop(stream);
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Reads until EOF or an error; how many bytes came, within 2 s.
    async fn read_to_end(stream: &mut TcpStream) -> Option<usize> {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut out))
            .await
            .ok()
            .map(|_| out.len())
    }

    #[tokio::test]
    async fn past_the_cap_a_connection_is_closed_and_a_freed_slot_serves_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut incoming = Box::pin(capped(listener, 2, Duration::from_secs(60)));
        let mut clients = Vec::new();
        let mut served = Vec::new();
        for _ in 0..2 {
            clients.push(TcpStream::connect(addr).await.expect("connect"));
            served.push(incoming.next().await.expect("item").expect("accepted"));
        }
        // The third is closed by the listener: its client reads EOF.
        let mut third = TcpStream::connect(addr).await.expect("the kernel accepts");
        let accepting = tokio::spawn(async move {
            let next = incoming.next().await;
            (incoming, next)
        });
        assert_eq!(read_to_end(&mut third).await, Some(0), "not closed");
        // A slot frees when its connection ends; the next one is served.
        drop(served.pop());
        let mut fourth = TcpStream::connect(addr).await.expect("connect");
        let (_incoming, next) = accepting.await.expect("task");
        let mut accepted = next.expect("item").expect("accepted");
        fourth.write_all(b"ping").await.expect("write");
        let mut buf = [0u8; 4];
        accepted.read_exact(&mut buf).await.expect("read");
        assert_eq!(&buf, b"ping");
    }

    #[tokio::test]
    async fn a_connection_that_says_nothing_fails_after_the_first_byte_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut incoming = Box::pin(capped(listener, 4, Duration::from_millis(200)));
        let _silent = TcpStream::connect(addr).await.expect("connect");
        let mut accepted = incoming.next().await.expect("item").expect("accepted");
        let started = std::time::Instant::now();
        let mut buf = [0u8; 1];
        let err = accepted.read(&mut buf).await.expect_err("timed out");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // One that talks in time keeps its connection past the limit.
        let mut talker = TcpStream::connect(addr).await.expect("connect");
        let mut accepted = incoming.next().await.expect("item").expect("accepted");
        talker.write_all(b"x").await.expect("write");
        accepted.read_exact(&mut buf).await.expect("first byte");
        tokio::time::sleep(Duration::from_millis(300)).await;
        talker.write_all(b"y").await.expect("write");
        accepted.read_exact(&mut buf).await.expect("still open");
        assert_eq!(&buf, b"y");
    }
}
