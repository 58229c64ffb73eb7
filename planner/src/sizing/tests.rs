use super::*;

fn config(scale_down_after: u32) -> PlannerConfig {
    let slo = Slo {
        ttft_s: 1.0,
        tpot_s: 0.1,
    };
    PlannerConfig {
        profile: Profile {
            slo,
            prefill_tokens_per_s: 1000.0,
            decode_tokens_per_s: 100.0,
        },
        slo,
        predictor: Predictor::Last,
        limits: Limits {
            min: Sizes {
                prefill: 1,
                decode: 1,
            },
            max: Sizes {
                prefill: 8,
                decode: 8,
            },
            max_total: 10,
        },
        utilisation: 1.0,
        scale_down_after,
        attainment_target: 0.9,
    }
}

fn load(prompt: f64, generation: f64, ttft: f64, tpot: f64) -> Interval {
    Interval {
        seconds: 10.0,
        finished: 20.0,
        failed: 0.0,
        prefill_tokens_per_s: prompt,
        generation_tokens_per_s: generation,
        ttft_attainment: Some(ttft),
        tpot_attainment: Some(tpot),
    }
}

const ONE_PAIR: Sizes = Sizes {
    prefill: 1,
    decode: 1,
};

#[test]
fn each_pool_is_sized_from_its_own_load_and_capacity() {
    let mut p = Planner::new(config(1));
    let d = p.plan(&load(2500.0, 250.0, 1.0, 1.0), ONE_PAIR, false);
    assert_eq!(
        d.wanted,
        Sizes {
            prefill: 3,
            decode: 3
        }
    );
    assert_eq!(d.target, d.wanted);
    // Bounds and the total: 8 + 8 wanted, 10 allowed.
    let d = p.plan(&load(1e6, 1e6, 1.0, 1.0), d.target, false);
    assert_eq!(d.target.total(), 10);
    assert_eq!((d.target.prefill, d.target.decode), (5, 5));
}

#[test]
fn pools_grow_at_once_and_shrink_one_at_a_time_after_a_streak() {
    let mut p = Planner::new(config(3));
    let big = Sizes {
        prefill: 1,
        decode: 4,
    };
    let mut now = big;
    let mut targets = Vec::new();
    for _ in 0..7 {
        let d = p.plan(&load(100.0, 50.0, 1.0, 1.0), now, false);
        now = d.target;
        targets.push(now.decode);
    }
    assert_eq!(targets, [4, 4, 3, 3, 3, 2, 2]);
    let d = p.plan(&load(100.0, 390.0, 1.0, 1.0), now, false);
    assert_eq!(d.target.decode, 4, "up at once");
}

#[test]
fn a_missed_objective_under_the_believed_capacity_corrects_it() {
    let mut p = Planner::new(config(1));
    // 2 decode workers at 60 tok/s each miss TPOT: capacity is not 100.
    let d = p.plan(
        &load(500.0, 120.0, 1.0, 0.5),
        Sizes {
            prefill: 1,
            decode: 2,
        },
        false,
    );
    assert!(
        (d.decode_capacity - 54.0).abs() < 1e-9,
        "{}",
        d.decode_capacity
    );
    assert_eq!(d.target.decode, 3);
    // A miss over the believed capacity is the load's fault, not the
    // profile's: only more workers.
    let mut q = Planner::new(config(1));
    let d = q.plan(&load(500.0, 400.0, 1.0, 0.2), ONE_PAIR, false);
    assert_eq!(d.decode_capacity, 100.0);
    assert_eq!(d.target.decode, 4);
    // Met objectives let the correction recover, 10% an interval.
    let d = p.plan(&load(500.0, 120.0, 1.0, 1.0), d.target, false);
    assert!(
        (d.decode_capacity - 59.4).abs() < 1e-9,
        "{}",
        d.decode_capacity
    );
}

#[test]
fn a_wrong_mix_switches_roles_instead_of_starting() {
    let mut p = Planner::new(config(3));
    let now = Sizes {
        prefill: 1,
        decode: 4,
    };
    // Prefill needs 3, decode 2: two decode workers switch now, without
    // waiting out decode's shrink streak.
    let d = p.plan(&load(2500.0, 150.0, 1.0, 1.0), now, true);
    assert_eq!(
        d.target,
        Sizes {
            prefill: 3,
            decode: 2
        }
    );
    assert_eq!(
        actions(now, d.target, true),
        [Action::Switch { to: Role::Prefill }; 2]
    );
    // Without switching, prefill starts two and decode waits its streak.
    let mut q = Planner::new(config(3));
    let d = q.plan(&load(2500.0, 150.0, 1.0, 1.0), now, false);
    assert_eq!(
        d.target,
        Sizes {
            prefill: 3,
            decode: 4
        }
    );
    assert_eq!(
        actions(now, d.target, false),
        [Action::Start(Role::Prefill); 2]
    );
}

#[test]
fn actions_mix_switches_starts_and_stops() {
    let from = Sizes {
        prefill: 2,
        decode: 2,
    };
    let to = Sizes {
        prefill: 5,
        decode: 1,
    };
    assert_eq!(
        actions(from, to, true),
        [
            Action::Switch { to: Role::Prefill },
            Action::Start(Role::Prefill),
            Action::Start(Role::Prefill)
        ]
    );
    assert_eq!(
        actions(to, from, false),
        [
            Action::Stop(Role::Prefill),
            Action::Stop(Role::Prefill),
            Action::Stop(Role::Prefill),
            Action::Start(Role::Decode)
        ]
    );
    assert!(actions(from, from, true).is_empty());
}

#[test]
fn workers_that_just_switched_do_not_switch_back_at_once() {
    let mut p = Planner::new(config(3));
    let mut now = Sizes {
        prefill: 1,
        decode: 4,
    };
    // Prompts heavy: two decode workers switch to prefill.
    let d = p.plan(&load(2500.0, 150.0, 1.0, 1.0), now, true);
    assert_eq!(
        actions(now, d.target, true),
        [Action::Switch { to: Role::Prefill }; 2]
    );
    now = d.target;
    // Generation heavy the next interval: decode grows by starting, not by
    // taking the workers back, until they have settled.
    let d = p.plan(&load(500.0, 390.0, 1.0, 1.0), now, true);
    assert_eq!(d.target.decode, 4);
    assert_eq!(d.target.prefill, 3);
    assert_eq!(
        actions(now, d.target, true),
        [Action::Start(Role::Decode); 2]
    );
}

#[test]
fn a_full_cluster_holds_rather_than_switch_back_settling_workers() {
    let mut cfg = config(3);
    cfg.limits.max_total = 5;
    let mut p = Planner::new(cfg);
    let mut now = Sizes {
        prefill: 1,
        decode: 4,
    };
    let d = p.plan(&load(2500.0, 150.0, 1.0, 1.0), now, true);
    now = d.target;
    assert_eq!((now.prefill, now.decode), (3, 2));
    // Decode wants 4 now, but the cluster is full and the prefill workers
    // have just switched: nothing moves.
    let d = p.plan(&load(500.0, 390.0, 1.0, 1.0), now, true);
    assert_eq!(d.target, now);
    assert!(actions(now, d.target, true).is_empty());
}
