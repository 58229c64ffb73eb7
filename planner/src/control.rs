//! The planner's loop: every interval, scrape the routers, turn the two
//! last scrapes into an [`Interval`], plan, and act. Each decision is
//! logged and, if asked, appended as a JSON line (what the ramp plot is
//! drawn from).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::actuator::{apply, Actuator};
use crate::http::HttpClient;
use crate::observe::{Interval, Snapshot};
use crate::prom::Exposition;
use crate::sizing::{actions, Decision, Planner};

/// Every scrape's deadline.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ScrapeError {
    #[error("no router answered: {0}")]
    NoRouter(String),
}

/// Reads the routers' `/metrics` and adds them up.
#[derive(Debug, Clone)]
pub struct Scraper {
    client: HttpClient,
    routers: Vec<String>,
    every_address: bool,
}

impl Scraper {
    /// `routers`: each replica's metrics URL (`http://HOST:PORT/metrics`).
    pub fn new(routers: Vec<String>) -> Self {
        Self {
            client: HttpClient::plain(SCRAPE_TIMEOUT),
            routers,
            every_address: false,
        }
    }

    /// Scrapes every address each URL's host resolves to (a headless
    /// Service names every router replica), not one.
    pub fn every_address(mut self) -> Self {
        self.every_address = true;
        self
    }

    /// The URLs to scrape now: as given, or one per resolved address.
    async fn urls(&self) -> Vec<String> {
        if !self.every_address {
            return self.routers.clone();
        }
        let mut out = Vec::new();
        for url in &self.routers {
            let Ok(uri) = url.parse::<hyper::Uri>() else {
                out.push(url.clone());
                continue;
            };
            let Some(host) = uri.host().map(str::to_string) else {
                out.push(url.clone());
                continue;
            };
            let port = uri.port_u16().unwrap_or(80);
            let path = uri.path_and_query().map_or("/metrics", |p| p.as_str());
            // A resolver that does not answer costs one scrape deadline.
            let lookup = tokio::net::lookup_host(format!("{host}:{port}"));
            match tokio::time::timeout(SCRAPE_TIMEOUT, lookup).await {
                Ok(Ok(addrs)) => out.extend(addrs.map(|a| format!("http://{a}{path}"))),
                Ok(Err(e)) => {
                    tracing::warn!(%url, error = %e, "resolving the routers");
                    out.push(url.clone());
                }
                Err(_) => {
                    tracing::warn!(%url, "resolving the routers timed out");
                    out.push(url.clone());
                }
            }
        }
        out
    }

    /// The routers' counters, summed; a replica that does not answer is
    /// left out (and logged) unless none does.
    pub async fn snapshot(&self) -> Result<Snapshot, ScrapeError> {
        let mut total: Option<Snapshot> = None;
        let mut errors = Vec::new();
        for url in &self.urls().await {
            let parsed = match self.client.get(url).await {
                Ok(r) if r.status == 200 => Exposition::parse(&r.text()).map_err(|e| e.to_string()),
                Ok(r) => Err(format!("status {}", r.status)),
                Err(e) => Err(e.to_string()),
            };
            match parsed {
                Ok(e) => {
                    let s = Snapshot::from_router(&e);
                    match &mut total {
                        Some(t) => t.merge(&s),
                        None => total = Some(s),
                    }
                }
                Err(e) => {
                    tracing::warn!(router = %url, error = %e, "scraping a router");
                    errors.push(format!("{url}: {e}"));
                }
            }
        }
        total.ok_or_else(|| ScrapeError::NoRouter(errors.join("; ")))
    }
}

/// The planner, its eyes and its hands.
pub struct ControlLoop {
    pub planner: Planner,
    pub scraper: Scraper,
    pub actuator: Arc<dyn Actuator>,
    pub interval: Duration,
    /// Where each decision goes as a JSON line.
    pub decisions: Option<Box<dyn Write + Send>>,
}

impl std::fmt::Debug for ControlLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlLoop")
            .field("planner", &self.planner)
            .field("scraper", &self.scraper)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl ControlLoop {
    /// Plans every interval until `stop` resolves.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let started = Instant::now();
        let mut last: Option<(Instant, Snapshot)> = None;
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => return,
                _ = ticker.tick() => {}
            }
            let snapshot = match self.scraper.snapshot().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "no metrics this interval; nothing changes");
                    continue;
                }
            };
            let now = Instant::now();
            if let Some((then, earlier)) = last.replace((now, snapshot.clone())) {
                let interval =
                    Interval::between(&earlier, &snapshot, now - then, self.planner.config().slo);
                self.step(&interval, started.elapsed()).await;
            }
        }
    }

    /// One interval: plan and act.
    pub async fn step(&mut self, interval: &Interval, at: Duration) -> Option<Decision> {
        let current = match self.actuator.sizes().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "reading the pools' sizes; nothing changes");
                return None;
            }
        };
        let can_switch = self.actuator.can_switch();
        let decision = self.planner.plan(interval, current, can_switch);
        let todo = actions(current, decision.target, can_switch);
        tracing::debug!(
            prefill_tokens_per_s = format!("{:.0}", interval.prefill_tokens_per_s),
            generation_tokens_per_s = format!("{:.0}", interval.generation_tokens_per_s),
            ttft_attainment = ?interval.ttft_attainment,
            tpot_attainment = ?interval.tpot_attainment,
            ?current,
            target = ?decision.target,
            "planner interval"
        );
        if !todo.is_empty() {
            tracing::info!(
                prefill_tokens_per_s = format!("{:.0}", decision.predicted_prefill_tokens_per_s),
                generation_tokens_per_s = format!("{:.0}", decision.predicted_generation_tokens_per_s),
                ?current,
                target = ?decision.target,
                actions = ?todo,
                "planner: resizing the pools"
            );
        }
        if let Err(e) = apply(self.actuator.as_ref(), current, &todo).await {
            tracing::warn!(error = %e, "acting on the plan");
        }
        if let Some(out) = &mut self.decisions {
            let line =
                serde_json::json!({"t_s": at.as_secs_f64(), "decision": decision, "actions": todo});
            let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        }
        Some(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers every connection with a router scrape of 7 finished requests.
    async fn metrics_server() -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut request = [0u8; 1024];
                let _ = s.read(&mut request).await;
                let body = "tandem_router_requests_total{outcome=\"finished\"} 7\n";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        port
    }

    #[tokio::test]
    async fn every_address_of_a_name_is_scraped_and_a_dead_one_left_out() {
        let port = metrics_server().await;
        // `localhost` may resolve to ::1 too, where nothing listens: that
        // replica is left out, not the scrape.
        let url = format!("http://localhost:{port}/metrics");
        let scraper = Scraper::new(vec![url.clone()]).every_address();
        let urls = scraper.urls().await;
        assert!(
            urls.iter().any(|u| u.starts_with("http://127.0.0.1:")),
            "{urls:?}"
        );
        assert_eq!(scraper.snapshot().await.expect("scrape").finished, 7.0);
        // Nobody answering at all is an error naming the router.
        let dead = Scraper::new(vec!["http://127.0.0.1:1/metrics".into()]);
        let err = dead.snapshot().await.expect_err("no router");
        assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
    }
}
