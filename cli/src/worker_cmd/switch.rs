//! `tandem worker --role ROLE`: a worker that changes pools without a
//! restart, which is how the planner fixes a wrong prefill/decode mix
//! (`tandem up --planner` starts its workers this way).
//!
//! SIGUSR1 tells it to switch to the other role. It leaves the membership
//! and drains exactly as on SIGTERM — a decode worker hands its requests
//! over to the other decode workers, which pull their KV blocks from it —
//! then clears its metrics, binds a fresh gRPC port (the router's tables
//! key on the address, so the new role is a new worker to them), registers
//! in the other pool and prints `switched to ROLE, listening on ADDR`. The
//! engine, with its weights and its prefix cache, stays up throughout.
//! SIGTERM and Ctrl-C stop it as they stop the other workers; a switch
//! needs etcd membership (a static list cannot learn the new role).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_discovery::Role;

use super::{leave_then_drain, serve_role, DecodeOptions, RoleContext, WorkerArgs};
use crate::engine_args::{runtime, shutdown_signal, start_engine};

#[derive(Args, Debug)]
pub struct SwitchableWorkerArgs {
    /// The pool it starts in: `prefill` or `decode`.
    #[arg(long)]
    role: Role,
    #[command(flatten)]
    worker: WorkerArgs,
    /// Used while it is a decode worker.
    #[command(flatten)]
    decode: DecodeOptions,
}

/// What ends a role's serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Stop,
    Switch,
}

/// SIGTERM/Ctrl-C and SIGUSR1 as a stream of [`Next`].
fn signals() -> Result<tokio::sync::mpsc::UnboundedReceiver<Next>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut usr1 = signal(SignalKind::user_defined1()).context("installing the SIGUSR1 handler")?;
    let stop = shutdown_signal();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let switches = tx.clone();
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            if switches.send(Next::Switch).is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move {
        stop.await;
        let _ = tx.send(Next::Stop);
    });
    Ok(rx)
}

pub fn run(args: SwitchableWorkerArgs) -> Result<()> {
    let SwitchableWorkerArgs {
        mut role,
        worker,
        decode,
    } = args;
    if worker.membership.etcd.is_empty() {
        bail!("tandem worker switches roles through etcd membership: give --etcd");
    }
    if worker.exit_on_stdin_eof {
        super::exit_on_stdin_eof();
    }
    let tls = worker.tls.load()?;
    let cluster_token = worker.cluster_token.load()?;
    let mut engine = start_engine(worker.model.as_deref(), &worker.engine)?;
    // Held until the loop ends: the other ranks stop when it is dropped.
    let ranks = engine._ranks.take();
    runtime()?.block_on(async move {
        let registry = tandem_telemetry::Registry::new();
        worker.metrics.start(&registry).await?;
        let mut events = signals()?;
        let mut switch_asked: Option<Instant> = None;
        loop {
            let (bound, id, reg) = worker.bind_and_register(role).await?;
            if let Some(asked) = switch_asked.take() {
                let took = asked.elapsed().as_secs_f64();
                tracing::info!(%role, seconds = took, "switched roles");
                println!(
                    "switched to {role} in {took:.2} s, listening on {}",
                    bound.local_addr()
                );
            }
            let mut next = Next::Stop;
            let signal = async {
                next = events.recv().await.unwrap_or(Next::Stop);
                if next == Next::Switch {
                    switch_asked = Some(Instant::now());
                    tracing::info!(from = %role, "switching roles: draining first");
                }
            };
            let hand_over = role == Role::Decode;
            let shutdown = leave_then_drain(signal, reg, engine.handle.clone(), hand_over);
            let ctx = RoleContext {
                engine: &engine,
                registry: &registry,
                worker: &worker,
                decode: &decode,
                id,
                cluster_token: &cluster_token,
                tls: tls.as_ref(),
            };
            serve_role(role, ctx, bound, shutdown).await?;
            if next == Next::Stop {
                break;
            }
            role = role.other();
            registry.clear();
        }
        drop(ranks);
        Ok(())
    })
}
