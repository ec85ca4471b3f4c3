//! The inspection of a finished sequence: per layer and kv head, the positions its KV policy
//! holds at the end by role (`KvPolicy::held`; a sliding-window layer holds its window), and
//! the policy's slow steps with their reasons (`KvPolicy::slow_log`). Read from the live
//! policy and store just before the sequence's KV is freed.
use slowfast_kv::{CacheElem, Held, KvPolicy, KvStore, SlowStep};
use slowfast_model::Model;

/// One layer's held positions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LayerHeld {
    pub layer: usize,
    /// A sliding-window layer (the policy leaves it alone: it holds the model's window).
    pub sliding: bool,
    /// Per kv head.
    pub heads: Vec<Held>,
}

/// What a sequence's policy held when it finished, and its slow steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Inspection {
    /// Positions written to the KV (the prompt and the generated tokens fed back; the last
    /// generated token is never fed).
    pub positions: usize,
    pub layers: Vec<LayerHeld>,
    /// The slow steps the policy logged (SFI), in order; None for policies without slow and
    /// fast steps.
    pub slow_steps: Option<Vec<SlowStep>>,
    /// All slow steps logged (the list keeps the first `SlowLog::DEFAULT_CAP`).
    pub slow_steps_total: usize,
}

impl Inspection {
    /// Reads `policy` over `store` of a sequence of `model`.
    pub(crate) fn of<T: CacheElem>(
        model: &Model,
        store: &KvStore<T>,
        policy: &dyn KvPolicy<T>,
    ) -> Self {
        let len = store.len();
        let layers = (0..store.n_layers())
            .map(|l| match model.cfg.sliding_window {
                Some(w) if model.cfg.is_sliding(l) => {
                    // A decode step at `len` sees keys from `len + 1 - w`.
                    let first = (len + 1).saturating_sub(w);
                    let held = Held::with_roles(0..0, &[], first..len);
                    LayerHeld {
                        layer: l,
                        sliding: true,
                        heads: vec![held; store.n_kv_heads],
                    }
                }
                _ => LayerHeld {
                    layer: l,
                    sliding: false,
                    heads: policy.held(l, store),
                },
            })
            .collect();
        let log = policy.slow_log();
        Inspection {
            positions: len,
            layers,
            slow_steps: log.map(|l| l.steps().to_vec()),
            slow_steps_total: log.map_or(0, |l| l.total()),
        }
    }
}
