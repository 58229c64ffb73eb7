//! Connection hygiene of the OpenAI HTTP listener against a real
//! `tandem serve` (issue 26): a client that sends half its headers
//! (slowloris) or nothing at all is closed after `--http-header-timeout-ms`,
//! and a connection past `--http-max-connections` gets a 503 in OpenAI's
//! shape instead of a socket held open for ever.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

fn tandem() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tandem"))
}

const MAX_CONNECTIONS: usize = 4;
const HEADER_TIMEOUT_MS: u64 = 500;

/// Reads until the server closes; what it sent, and how long that took.
/// Panics if the server keeps the connection open for `limit`.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let started = Instant::now();
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is the server closing too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "the server kept the connection open for {:?}: {e}",
                started.elapsed()
            ),
        }
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

fn get_health(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connects");
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("sends");
    read_until_closed(&mut s, Duration::from_secs(10)).0
}

#[test]
fn slow_and_silent_clients_are_closed_and_connections_are_capped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    tandem_tests::cluster::gen_model(tandem(), &model, "tiny");
    let server = tandem_tests::cluster::start(
        tandem(),
        &[
            "serve",
            "--model",
            model.to_str().expect("utf8"),
            "--addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--num-kv-blocks",
            "64",
            "--http-max-connections",
            &MAX_CONNECTIONS.to_string(),
            "--http-header-timeout-ms",
            &HEADER_TIMEOUT_MS.to_string(),
        ],
    );
    let http = server.http.clone().expect("http API");
    assert!(get_health(&http).starts_with("HTTP/1.1 200"));

    // Slowloris: half a request, then nothing.
    let mut slow = TcpStream::connect(&http).expect("connects");
    write!(
        slow,
        "POST /v1/completions HTTP/1.1\r\nHost: {http}\r\nContent-Ty"
    )
    .expect("sends");
    let (_, took) = read_until_closed(&mut slow, Duration::from_secs(10));
    let bound = Duration::from_millis(HEADER_TIMEOUT_MS) + Duration::from_secs(3);
    assert!(took < bound, "closed after {took:?}, bound {bound:?}");

    // The cap: silent connections fill it; the next one is told why.
    let mut silent: Vec<TcpStream> = (0..MAX_CONNECTIONS)
        .map(|_| TcpStream::connect(&http).expect("connects"))
        .collect();
    // Let the server accept them all before the one past the cap.
    std::thread::sleep(Duration::from_millis(100));
    let refused = get_health(&http);
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("too_many_connections"), "{refused}");
    // The silent ones are closed by the header timeout, freeing the cap.
    for s in &mut silent {
        let (_, took) = read_until_closed(s, Duration::from_secs(10));
        assert!(took < bound, "a silent connection lived {took:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = get_health(&http);
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "the cap never freed: {answer}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
