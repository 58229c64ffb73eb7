//! Where the planner's decisions take effect, behind one trait: the local
//! supervisor (`tandem up --planner` starts, stops and switches worker
//! processes) and Kubernetes (the `scale` subresource of the prefill and
//! decode Deployments, [`crate::kubernetes`]).
//!
//! Scale-down never drops a request: a stopped worker drains (it leaves
//! the membership, so the router stops sending, then finishes or hands over
//! what it has), and so does a switching one before it joins its new pool.

use async_trait::async_trait;
use tandem_discovery::Role;
use thiserror::Error;

use crate::sizing::{Action, Sizes};

#[derive(Debug, Error)]
pub enum ActuatorError {
    #[error("{0}")]
    Failed(String),
    #[error("{0} is not supported by this actuator")]
    Unsupported(&'static str),
    #[error("the Kubernetes API answered {status} to {what}: {body}")]
    Api {
        what: String,
        status: u16,
        body: String,
    },
    #[error("{what}: {source}")]
    Http {
        what: String,
        source: crate::http::HttpError,
    },
}

/// What changes the pools.
#[async_trait]
pub trait Actuator: Send + Sync {
    /// The workers each pool has now (or is being moved to).
    async fn sizes(&self) -> Result<Sizes, ActuatorError>;
    /// Moves `role`'s pool to `workers`.
    async fn scale(&self, role: Role, workers: usize) -> Result<(), ActuatorError>;
    /// Turns one worker of the other pool into one of `to`, its model kept
    /// loaded.
    async fn switch(&self, to: Role) -> Result<(), ActuatorError>;
    /// Whether [`Self::switch`] is available.
    fn can_switch(&self) -> bool;
}

/// Carries out `actions` from `current`: the switches first (they keep the
/// total), then each pool's starts or stops as one scale call. Returns the
/// sizes reached.
pub async fn apply(
    actuator: &dyn Actuator,
    current: Sizes,
    actions: &[Action],
) -> Result<Sizes, ActuatorError> {
    let mut now = current;
    let mut target = current;
    for action in actions {
        match *action {
            Action::Switch { to } => {
                actuator.switch(to).await?;
                for sizes in [&mut now, &mut target] {
                    *sizes.get_mut(to) += 1;
                    let from = sizes.get_mut(to.other());
                    *from = from.saturating_sub(1);
                }
            }
            Action::Start(role) => *target.get_mut(role) += 1,
            Action::Stop(role) => {
                let n = target.get_mut(role);
                *n = n.saturating_sub(1);
            }
        }
    }
    for role in Role::ALL {
        if target.get(role) != now.get(role) {
            actuator.scale(role, target.get(role)).await?;
            *now.get_mut(role) = target.get(role);
        }
    }
    Ok(now)
}
