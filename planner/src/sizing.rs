//! How many workers each pool needs for the next interval.
//!
//! Each pool's need is its predicted load over what one worker sustains
//! within the objective: `ceil(load / (profiled tokens/s × correction ×
//! utilisation))`, clamped to the pool's bounds and the cluster's total.
//!
//! * **Correction** (per pool, 0.25–1): the profile was measured on one
//!   workload; when a pool misses its objective (TTFT → prefill, TPOT →
//!   decode) while its observed load per worker was under the capacity the
//!   planner believed, that belief was too high: it drops to 90% of the
//!   load per worker that missed. Each interval that meets the objective
//!   lets it recover by 10%.
//! * **Hysteresis**: a pool grows at once; it shrinks by one worker, and
//!   only after `scale_down_after` intervals in a row wanted fewer (a drain
//!   costs more than an idle worker for a minute).
//! * **Switching before starting**: when one pool must grow and the other
//!   wants fewer workers than it has (due or not), the surplus workers
//!   switch roles, which keeps their model loaded and the total unchanged.

use serde::Serialize;
use tandem_discovery::Role;

use crate::observe::{Interval, Slo};
use crate::predict::{Forecast, Predictor};
use crate::profile::Profile;

/// Workers per pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sizes {
    pub prefill: usize,
    pub decode: usize,
}

impl Sizes {
    pub fn get(self, role: Role) -> usize {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }

    pub fn get_mut(&mut self, role: Role) -> &mut usize {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        }
    }

    pub fn total(self) -> usize {
        self.prefill + self.decode
    }
}

/// Bounds on the pools.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub min: Sizes,
    pub max: Sizes,
    /// Workers in all (the machines or GPUs there are).
    pub max_total: usize,
}

/// The planner's settings.
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    pub profile: Profile,
    pub slo: Slo,
    pub predictor: Predictor,
    pub limits: Limits,
    /// Plan each worker for this share of its profiled capacity.
    pub utilisation: f64,
    /// Intervals in a row a pool must want fewer workers before one goes.
    pub scale_down_after: u32,
    /// The share of requests within an objective that counts as meeting it.
    pub attainment_target: f64,
}

/// The lowest correction: a profile four times too optimistic.
const MIN_CORRECTION: f64 = 0.25;
/// How much a met objective lets the correction recover per interval.
const RECOVERY: f64 = 1.1;
/// An interval needs this many observations for its attainment to count.
const MIN_OBSERVATIONS: f64 = 5.0;

/// One interval's plan, for logs and plots.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub interval: Interval,
    /// Predicted prompt and generated tokens per second.
    pub predicted_prefill_tokens_per_s: f64,
    pub predicted_generation_tokens_per_s: f64,
    /// Tokens/s one worker is planned for, after correction.
    pub prefill_capacity: f64,
    pub decode_capacity: f64,
    pub current: Sizes,
    /// What the load alone asks for.
    pub wanted: Sizes,
    /// What the cluster is moved to (hysteresis, switching and bounds).
    pub target: Sizes,
}

/// The planner's state between intervals.
#[derive(Debug)]
pub struct Planner {
    config: PlannerConfig,
    prefill_load: Forecast,
    generation_load: Forecast,
    correction: [f64; 2],
    /// Intervals in a row each pool wanted fewer workers.
    shrink_streak: [u32; 2],
    /// Intervals planned so far, and the last one that switched workers
    /// into each pool.
    intervals: u64,
    switched_into: [Option<u64>; 2],
}

fn slot(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

impl Planner {
    pub fn new(config: PlannerConfig) -> Self {
        Self {
            prefill_load: Forecast::new(config.predictor),
            generation_load: Forecast::new(config.predictor),
            config,
            correction: [1.0; 2],
            shrink_streak: [0; 2],
            intervals: 0,
            switched_into: [None; 2],
        }
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// What the profile says one worker of `role` sustains.
    fn profiled(&self, role: Role) -> f64 {
        match role {
            Role::Prefill => self.config.profile.prefill_tokens_per_s,
            Role::Decode => self.config.profile.decode_tokens_per_s,
        }
    }

    fn capacity(&self, role: Role) -> f64 {
        self.profiled(role) * self.correction[slot(role)] * self.config.utilisation
    }

    /// Learns from the interval's attainment (see the module doc).
    fn correct(
        &mut self,
        role: Role,
        attainment: Option<f64>,
        load: f64,
        observations: f64,
        workers: usize,
    ) {
        let Some(attainment) = attainment.filter(|_| observations >= MIN_OBSERVATIONS) else {
            return;
        };
        let profiled = self.profiled(role);
        let c = &mut self.correction[slot(role)];
        if attainment >= self.config.attainment_target {
            *c = (*c * RECOVERY).min(1.0);
            return;
        }
        let per_worker = load / workers.max(1) as f64;
        if per_worker < profiled * *c {
            *c = (0.9 * per_worker / profiled).clamp(MIN_CORRECTION, 1.0);
        }
    }

    /// Plans the next interval from the last one and the cluster now.
    pub fn plan(&mut self, interval: &Interval, current: Sizes, can_switch: bool) -> Decision {
        let observations = interval.finished + interval.failed;
        self.correct(
            Role::Prefill,
            interval.ttft_attainment,
            interval.prefill_tokens_per_s,
            observations,
            current.prefill,
        );
        self.correct(
            Role::Decode,
            interval.tpot_attainment,
            interval.generation_tokens_per_s,
            observations,
            current.decode,
        );
        self.prefill_load.observe(interval.prefill_tokens_per_s);
        self.generation_load
            .observe(interval.generation_tokens_per_s);
        let (prompt, generation) = (self.prefill_load.predict(), self.generation_load.predict());
        let limits = self.config.limits;
        let need = |load: f64, capacity: f64, role: Role| {
            ((load / capacity).ceil() as usize).clamp(limits.min.get(role), limits.max.get(role))
        };
        let mut wanted = Sizes {
            prefill: need(prompt, self.capacity(Role::Prefill), Role::Prefill),
            decode: need(generation, self.capacity(Role::Decode), Role::Decode),
        };
        fit_total(&mut wanted, limits, None);
        let target = self.target(current, wanted, can_switch);
        Decision {
            interval: *interval,
            predicted_prefill_tokens_per_s: prompt,
            predicted_generation_tokens_per_s: generation,
            prefill_capacity: self.capacity(Role::Prefill),
            decode_capacity: self.capacity(Role::Decode),
            current,
            wanted,
            target,
        }
    }

    /// Hysteresis, then switching before starting, then the total.
    fn target(&mut self, current: Sizes, wanted: Sizes, can_switch: bool) -> Sizes {
        let mut target = current;
        for role in Role::ALL {
            let (have, want) = (current.get(role), wanted.get(role));
            let streak = &mut self.shrink_streak[slot(role)];
            if want >= have {
                *streak = 0;
                *target.get_mut(role) = want;
            } else {
                *streak += 1;
                if *streak >= self.config.scale_down_after {
                    *streak = 0;
                    *target.get_mut(role) = have - 1;
                }
            }
        }
        self.intervals += 1;
        if can_switch {
            for (up, down) in [(Role::Prefill, Role::Decode), (Role::Decode, Role::Prefill)] {
                // Workers that just switched the other way stay a while: a
                // load between two mixes must not swing workers to and fro.
                let settling = self.switched_into[slot(down)].is_some_and(|at| {
                    self.intervals - at <= u64::from(self.config.scale_down_after)
                });
                let grows = target.get(up).saturating_sub(current.get(up));
                let surplus = target.get(down).saturating_sub(wanted.get(down));
                let moved = if settling { 0 } else { grows.min(surplus) };
                if moved > 0 {
                    *target.get_mut(down) -= moved;
                    self.shrink_streak[slot(down)] = 0;
                    self.switched_into[slot(up)] = Some(self.intervals);
                }
            }
        }
        fit_total(&mut target, self.config.limits, Some(current));
        target
    }
}

/// Takes workers away until the total fits: first from a pool that would
/// grow beyond `current` (a start that does not fit is not made; taking
/// from the other pool instead would turn it into a switch the planner did
/// not choose), then from the larger pool, never under a pool's minimum.
fn fit_total(sizes: &mut Sizes, limits: Limits, current: Option<Sizes>) {
    while sizes.total() > limits.max_total {
        let grown = current.and_then(|c| {
            Role::ALL
                .into_iter()
                .filter(|&r| sizes.get(r) > c.get(r))
                .max_by_key(|&r| sizes.get(r) - c.get(r))
        });
        let role = match (grown, sizes.prefill > sizes.decode) {
            (Some(r), _) => r,
            (None, true) => Role::Prefill,
            (None, false) => Role::Decode,
        };
        let pick = [role, role.other()]
            .into_iter()
            .find(|&r| sizes.get(r) > limits.min.get(r));
        match pick {
            Some(r) => *sizes.get_mut(r) -= 1,
            None => return,
        }
    }
}

/// One step that moves the cluster toward a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Action {
    /// A new worker in the pool.
    Start(Role),
    /// A worker of the pool drains and stops.
    Stop(Role),
    /// A worker of the other pool drains its work there and joins this one.
    Switch { to: Role },
}

/// The actions from `current` to `target`: switches where one pool shrinks
/// while the other grows (if the actuator can), then stops and starts.
pub fn actions(current: Sizes, target: Sizes, can_switch: bool) -> Vec<Action> {
    let delta = |r: Role| target.get(r) as i64 - current.get(r) as i64;
    let (dp, dd) = (delta(Role::Prefill), delta(Role::Decode));
    let mut out = Vec::new();
    let switches = match can_switch {
        true if dp > 0 && dd < 0 => dp.min(-dd),
        true if dd > 0 && dp < 0 => dd.min(-dp),
        _ => 0,
    };
    let to = if dp > 0 { Role::Prefill } else { Role::Decode };
    out.extend((0..switches).map(|_| Action::Switch { to }));
    for (role, d) in [(Role::Prefill, dp), (Role::Decode, dd)] {
        let rest = d.abs() - switches;
        let action = if d > 0 {
            Action::Start(role)
        } else {
            Action::Stop(role)
        };
        out.extend((0..rest.max(0)).map(|_| action));
    }
    out
}

#[cfg(test)]
mod tests;
