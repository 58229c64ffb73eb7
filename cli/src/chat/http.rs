//! `tandem chat --http`: one streamed `POST /v1/chat/completions` per
//! answer to an OpenAI-compatible server (the router's HTTP API, or any
//! other), read as server-sent events. Plain HTTP/1.1 on a fresh
//! connection each turn; dropping the answer closes the connection, which
//! is how the server learns the client left.

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tandem_openai::chat::Message;

use super::backend::{CONNECT_TIMEOUT, IDLE_TIMEOUT};
use super::{Settings, TurnStats};

/// A server-sent event line longer than this is refused.
const MAX_LINE_BYTES: usize = 1 << 20;
/// An error body is read up to this much.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// An OpenAI-compatible chat endpoint.
pub struct HttpChat {
    url: String,
    authority: String,
    path: String,
    model: Option<String>,
    api_key: Option<String>,
}

/// Aborts the connection's task when the answer ends or is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl HttpChat {
    /// `url` is `http://host:port`, optionally with a path ending in `/v1`.
    pub fn new(url: &str, model: Option<String>, api_key: Option<String>) -> Result<Self> {
        let uri: hyper::Uri = url.parse().with_context(|| format!("--http {url:?}"))?;
        if uri.scheme_str() != Some("http") {
            bail!("--http {url:?}: want http://HOST:PORT (TLS is not spoken here)");
        }
        let authority = uri
            .authority()
            .with_context(|| format!("--http {url:?} has no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        let base = uri.path().trim_end_matches('/');
        let path = match base.ends_with("/v1") {
            true => format!("{base}/chat/completions"),
            false => format!("{base}/v1/chat/completions"),
        };
        Ok(Self {
            url: url.to_string(),
            authority: format!("{}:{port}", authority.host()),
            path,
            model,
            api_key,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn answer(
        &mut self,
        messages: &[Message],
        settings: &Settings,
        show: &mut dyn FnMut(&str),
    ) -> Result<TurnStats> {
        let start = Instant::now();
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect(&self.authority),
        )
        .await
        .map_err(|_| anyhow!("connecting to {}: timed out", self.authority))?
        .with_context(|| format!("connecting to {}", self.authority))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .context("HTTP handshake")?;
        let _conn = AbortOnDrop(tokio::spawn(async move {
            let _ = conn.await;
        }));
        let mut body = json!({
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
        });
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        let mut req = hyper::Request::post(self.path.as_str())
            .header(HOST, &self.authority)
            .header(CONTENT_TYPE, "application/json");
        if let Some(k) = &self.api_key {
            req = req.header(AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = req.body(Full::new(Bytes::from(body.to_string())))?;
        let resp = tokio::time::timeout(IDLE_TIMEOUT, sender.send_request(req))
            .await
            .map_err(|_| anyhow!("no answer in {IDLE_TIMEOUT:?}"))?
            .context("sending the request")?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let mut text = Vec::new();
            while let Some(Ok(frame)) = tokio::time::timeout(IDLE_TIMEOUT, body.frame())
                .await
                .ok()
                .flatten()
            {
                if let Ok(data) = frame.into_data() {
                    text.extend_from_slice(&data);
                }
                if text.len() > MAX_ERROR_BYTES {
                    break;
                }
            }
            let text = String::from_utf8_lossy(&text);
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or_else(|| text.into_owned());
            bail!("HTTP {status}: {message}");
        }
        let mut stats = TurnStats::default();
        let mut pending = Vec::new();
        loop {
            let frame = tokio::time::timeout(IDLE_TIMEOUT, body.frame())
                .await
                .map_err(|_| anyhow!("the answer stalled for {IDLE_TIMEOUT:?}"))?;
            let Some(frame) = frame else { break };
            let Ok(data) = frame.context("reading the answer")?.into_data() else {
                continue;
            };
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                if event(line.trim_end(), &mut stats, start, show)? {
                    stats.elapsed = start.elapsed();
                    return Ok(stats);
                }
            }
            if pending.len() > MAX_LINE_BYTES {
                bail!("an event line longer than {MAX_LINE_BYTES} bytes");
            }
        }
        bail!("the stream ended without data: [DONE]")
    }
}

/// Handles one line of the event stream; true at `data: [DONE]`.
fn event(
    line: &str,
    stats: &mut TurnStats,
    start: Instant,
    show: &mut dyn FnMut(&str),
) -> Result<bool> {
    let Some(data) = line.strip_prefix("data:") else {
        return Ok(false);
    };
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(true);
    }
    let v: Value = serde_json::from_str(data).with_context(|| format!("event {data:?}"))?;
    if let Some(e) = v.get("error") {
        bail!("{}", e["message"].as_str().unwrap_or("the server failed"));
    }
    let choice = &v["choices"][0];
    if let Some(text) = choice["delta"]["content"].as_str() {
        if !text.is_empty() {
            stats.ttft.get_or_insert_with(|| start.elapsed());
            show(text);
        }
    }
    if let Some(reason) = choice["finish_reason"].as_str() {
        stats.finish_reason = reason.to_string();
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        stats.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
        stats.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_map_to_the_chat_endpoint() {
        let c = HttpChat::new("http://127.0.0.1:8000", None, None).expect("url");
        assert_eq!(
            (c.authority.as_str(), c.path.as_str()),
            ("127.0.0.1:8000", "/v1/chat/completions")
        );
        let c = HttpChat::new("http://localhost:9/v1/", None, None).expect("url");
        assert_eq!(c.path, "/v1/chat/completions");
        assert!(HttpChat::new("https://x:1", None, None).is_err());
    }

    #[test]
    fn events_stream_text_usage_and_done() {
        let mut stats = TurnStats::default();
        let mut shown = String::new();
        let start = Instant::now();
        let mut show = |s: &str| shown.push_str(s);
        let lines = [
            r#"data: {"choices":[{"delta":{"role":"assistant"}}]}"#,
            r#"data: {"choices":[{"delta":{"content":"Hel"}}]}"#,
            "",
            r#"data: {"choices":[{"delta":{"content":"lo"},"finish_reason":"length"}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#,
        ];
        for l in lines {
            assert!(!event(l, &mut stats, start, &mut show).expect("event"));
        }
        assert!(event("data: [DONE]", &mut stats, start, &mut show).expect("done"));
        let err = event(
            r#"data: {"error":{"message":"boom"}}"#,
            &mut stats,
            start,
            &mut show,
        );
        assert!(err.is_err());
        assert_eq!(shown, "Hello");
        assert_eq!((stats.prompt_tokens, stats.completion_tokens), (7, 2));
        assert_eq!(stats.finish_reason, "length");
        assert!(stats.ttft.is_some());
    }
}
