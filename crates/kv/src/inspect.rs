//! Inspection: what a policy holds at the end of a request, by role (sink, Selector-chosen or
//! otherwise kept, recent window), and the log of its slow steps with their reasons. Read
//! only; the server's `/v1/inspect/{id}` and the playground show it.
use std::ops::Range;

use serde::Serialize;

use crate::policy::sorted_runs;

/// The positions one kv head of one layer holds, as sorted, disjoint runs `[start, end)` per
/// role. Roles never overlap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Held {
    /// Attention sinks (the first tokens, kept by StreamingLLM and SFI).
    pub sinks: Vec<[u32; 2]>,
    /// Chosen by the policy's scoring: SFI's Selector, H2O's heavy hitters.
    pub selected: Vec<[u32; 2]>,
    /// The recent window (read in place by SFI and StreamingLLM, H2O's newest keys, a
    /// sliding-window layer's window).
    pub recent: Vec<[u32; 2]>,
    /// Held with no role of the above: everything of a dense layer, what a one-shot
    /// compressor (SnapKV, PyramidKV, FastKV) kept.
    pub kept: Vec<[u32; 2]>,
}

fn run(r: Range<usize>) -> [u32; 2] {
    [r.start as u32, r.end as u32]
}

/// Runs of `positions` (any order, duplicates allowed).
pub fn runs_of(positions: &[u32]) -> Vec<[u32; 2]> {
    let mut p: Vec<usize> = positions.iter().map(|&x| x as usize).collect();
    p.sort_unstable();
    p.dedup();
    sorted_runs(&p).map(run).collect()
}

impl Held {
    /// Every position of `r` held with no particular role.
    pub fn kept_range(r: Range<usize>) -> Self {
        Held {
            kept: if r.is_empty() { vec![] } else { vec![run(r)] },
            ..Held::default()
        }
    }

    /// The slots a store holds (any order) with no particular role.
    pub fn kept_slots(positions: &[u32]) -> Self {
        Held {
            kept: runs_of(positions),
            ..Held::default()
        }
    }

    /// `sinks` first positions, `recent` positions, `selected` positions (any order); a
    /// selected position inside the sinks or the recent range counts there only.
    pub fn with_roles(sinks: Range<usize>, selected: &[u32], recent: Range<usize>) -> Self {
        let sel: Vec<u32> = selected
            .iter()
            .copied()
            .filter(|&p| !sinks.contains(&(p as usize)) && !recent.contains(&(p as usize)))
            .collect();
        Held {
            sinks: if sinks.is_empty() {
                vec![]
            } else {
                vec![run(sinks)]
            },
            selected: runs_of(&sel),
            recent: if recent.is_empty() {
                vec![]
            } else {
                vec![run(recent)]
            },
            kept: vec![],
        }
    }

    /// Number of runs over all roles (the size of this record).
    pub fn runs(&self) -> usize {
        self.sinks.len() + self.selected.len() + self.recent.len() + self.kept.len()
    }

    /// Number of positions held over all roles.
    pub fn positions(&self) -> usize {
        [&self.sinks, &self.selected, &self.recent, &self.kept]
            .iter()
            .flat_map(|v| v.iter())
            .map(|r| (r[1] - r[0]) as usize)
            .sum()
    }

    /// Keep at most `max` runs, the roles in order sinks, recent, selected, kept (the
    /// selected runs are cut from the end); true when something was cut.
    pub fn truncate_runs(&mut self, max: usize) -> bool {
        let mut left = max;
        let mut cut = false;
        for v in [
            &mut self.sinks,
            &mut self.recent,
            &mut self.selected,
            &mut self.kept,
        ] {
            if v.len() > left {
                v.truncate(left);
                cut = true;
            }
            left -= v.len();
        }
        cut
    }
}

/// Why a decode step ran densely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlowReason {
    /// The first token of a new sentence (SFI's punct trigger).
    Sentence,
    /// `refresh_interval` steps since the last refresh (SFI's punct trigger).
    Interval,
    /// The periodic trigger.
    Periodic,
    /// The random trigger.
    Random,
    /// SFI's drift signal: the fast steps' attention left the memory (`--sfi-drift`).
    Drift,
    /// No memory yet on some layer (the sequence just grew past the budget): a dense step
    /// that builds it.
    Bootstrap,
    /// The sequence is not longer than the budget: dense, nothing to select.
    Short,
    /// A speculative verification that refreshed the memory.
    Verify,
    /// Joined a slow step another sequence of the batch fired (riding,
    /// `sfi::trigger::riders`).
    Ride,
}

/// One slow step: the position of the token it fed, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SlowStep {
    pub position: u32,
    pub reason: SlowReason,
}

/// The slow steps of a sequence, the first `cap` kept, all counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlowLog {
    steps: Vec<SlowStep>,
    total: usize,
    cap: usize,
}

impl SlowLog {
    /// Steps kept at most by default (a serving context is at most 8192 tokens by default).
    pub const DEFAULT_CAP: usize = 8192;

    pub fn new(cap: usize) -> Self {
        SlowLog {
            steps: Vec::new(),
            total: 0,
            cap,
        }
    }

    pub fn push(&mut self, position: usize, reason: SlowReason) {
        self.total += 1;
        if self.steps.len() < self.cap {
            self.steps.push(SlowStep {
                position: position as u32,
                reason,
            });
        }
    }

    /// Forget the steps at positions `>= len` (speculative decoding cut them off). Steps
    /// are logged in position order, so when a kept step goes, every step past the cap went
    /// with it; otherwise the steps past the cap stay counted.
    pub fn truncate(&mut self, len: usize) {
        let before = self.steps.len();
        self.steps.retain(|s| (s.position as usize) < len);
        if self.steps.len() < before {
            self.total = self.steps.len();
        }
    }

    /// The kept steps, in order.
    pub fn steps(&self) -> &[SlowStep] {
        &self.steps
    }

    /// All steps logged (kept or not).
    pub fn total(&self) -> usize {
        self.total
    }
}

impl Default for SlowLog {
    fn default() -> Self {
        Self::new(Self::DEFAULT_CAP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_disjoint_runs() {
        let h = Held::with_roles(0..4, &[2, 9, 10, 11, 30, 50, 51, 13], 48..60);
        assert_eq!(h.sinks, vec![[0, 4]]);
        assert_eq!(h.selected, vec![[9, 12], [13, 14], [30, 31]]);
        assert_eq!(h.recent, vec![[48, 60]]);
        assert!(h.kept.is_empty());
        assert_eq!(h.runs(), 5);
        assert_eq!(h.positions(), 4 + 3 + 1 + 1 + 12);
        assert_eq!(Held::kept_slots(&[5, 3, 4, 9]).kept, vec![[3, 6], [9, 10]]);
        assert_eq!(Held::kept_range(0..0), Held::default());
        assert_eq!(
            Held::with_roles(0..0, &[], 0..0),
            Held::default(),
            "empty roles have no runs"
        );
    }

    #[test]
    fn truncation_keeps_sinks_and_recent_first() {
        let sel: Vec<u32> = (0..20).map(|i| 10 + 2 * i).collect();
        let mut h = Held::with_roles(0..4, &sel, 100..120);
        assert_eq!(h.runs(), 22);
        assert!(!h.clone().truncate_runs(22));
        assert!(h.truncate_runs(5));
        assert_eq!(h.runs(), 5);
        assert_eq!((h.sinks.len(), h.recent.len(), h.selected.len()), (1, 1, 3));
        assert_eq!(h.selected[0], [10, 11]);
        let mut h2 = Held::with_roles(0..4, &sel, 100..120);
        assert!(h2.truncate_runs(0));
        assert_eq!(h2.runs(), 0);
    }

    #[test]
    fn slow_log_caps_and_counts() {
        let mut l = SlowLog::new(2);
        l.push(10, SlowReason::Sentence);
        l.push(20, SlowReason::Interval);
        l.push(30, SlowReason::Interval);
        assert_eq!(l.total(), 3);
        assert_eq!(l.steps().len(), 2);
        assert_eq!(l.steps()[1].position, 20);
        l.truncate(15);
        assert_eq!(l.steps().len(), 1);
        assert_eq!(
            l.total(),
            1,
            "the steps past the cap were after the cut too"
        );
        let j = serde_json::to_string(&l.steps()[0]).unwrap();
        assert_eq!(j, r#"{"position":10,"reason":"sentence"}"#);
    }
}
