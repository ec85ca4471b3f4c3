//! `--tensor-parallel N` on the CPU: one sequence run by N ranks (`Model::shard`), each in its
//! own thread with its own KV cache and its own copy of the KV policy over the kv heads it
//! holds, meeting in the decoder's collectives (`ThreadGroup`). It is the reference the GPU's
//! NCCL ranks are to agree with, and it measures what a per-rank policy costs in quality (SFI
//! selects per rank: cross-head exclusivity among the rank's own kv heads; a replicated kv
//! head from every query head, gathered by `KvShare`). Not a speed path: the ranks share the
//! CPU.
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use slowfast_kv::PolicyStats;
use slowfast_model::tp::{Communicator, ThreadGroup, TpPlan};
use slowfast_model::{Model, ModelError};

use crate::session::{KvDtype, PolicySpec, Session};
use crate::EngineError;

/// Check that `model` splits over `tp` ranks (heads, kv heads, MLP columns, quant blocks).
pub fn check(model: &Model, tp: usize) -> Result<TpPlan, EngineError> {
    let plan = TpPlan::new(&model.cfg, tp).map_err(|e| EngineError::BadInput(e.to_string()))?;
    plan.check_weights(&model.cfg, &model.weights)
        .map_err(|e| EngineError::BadInput(e.to_string()))?;
    Ok(plan)
}

enum Cmd {
    Prefill(Arc<[u32]>),
    Step(u32),
}

enum Reply {
    /// The rank built its session (its policy's name), or could not.
    Ready(Result<&'static str, EngineError>),
    /// Rank 0's prefill progress (tokens done, total).
    Progress(usize, usize),
    /// A forward finished: rank 0 sends its logits, the others an empty vector.
    Logits(Vec<f32>),
    Failed(String),
}

struct Rank {
    tx: Sender<Cmd>,
    rx: Receiver<Reply>,
    /// KV bytes and policy stats after the last command.
    state: Arc<std::sync::Mutex<(usize, PolicyStats)>>,
    handle: Option<JoinHandle<()>>,
}

/// A sequence decoded by `tp` CPU ranks in lockstep (see the module doc).
pub struct TpSession {
    ranks: Vec<Rank>,
    logits: Vec<f32>,
    policy_name: &'static str,
}

impl TpSession {
    /// `tp` rank models of `model` in threads, each with a session of `max_tokens` under
    /// `policy`. Errors name what does not split.
    pub fn new(
        model: &Model,
        tp: usize,
        max_tokens: usize,
        kv: KvDtype,
        chunk: usize,
        policy: &PolicySpec,
    ) -> Result<TpSession, EngineError> {
        let plan = check(model, tp)?;
        if let PolicySpec::Sfi { cfg, .. } = policy {
            if cfg.drift > 0.0 {
                return Err(EngineError::BadInput(
                    "--tensor-parallel with --sfi-drift: each rank measures its own drift, and broadcasting rank 0's decision is not wired yet; run it at --tensor-parallel 1".into(),
                ));
            }
        }
        let comms = ThreadGroup::new(tp);
        let mut ranks = Vec::with_capacity(tp);
        for (r, comm) in comms.into_iter().enumerate() {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let rank_model = model
                .shard(&plan, r, comm)
                .map_err(|e| EngineError::BadInput(e.to_string()))?;
            let (tx, cmd_rx) = channel::<Cmd>();
            let (reply_tx, rx) = channel::<Reply>();
            let state = Arc::new(std::sync::Mutex::new((0, PolicyStats::default())));
            let st = state.clone();
            let policy = policy.clone();
            let handle = std::thread::Builder::new()
                .name(format!("tp-rank-{r}"))
                .spawn(move || {
                    rank_loop(
                        r, rank_model, max_tokens, kv, chunk, policy, cmd_rx, reply_tx, st,
                    )
                })
                .map_err(|e| EngineError::BadInput(format!("cannot start rank {r}: {e}")))?;
            ranks.push(Rank {
                tx,
                rx,
                state,
                handle: Some(handle),
            });
        }
        let mut s = TpSession {
            ranks,
            logits: Vec::new(),
            policy_name: "",
        };
        // Every rank reports its session built (a bad policy fails here, not at the first
        // step); on an error dropping `s` stops the ranks that did start.
        for (r, rank) in s.ranks.iter().enumerate() {
            match rank.rx.recv() {
                Ok(Reply::Ready(Ok(name))) => s.policy_name = name,
                Ok(Reply::Ready(Err(e))) => return Err(e),
                _ => {
                    return Err(EngineError::Model(ModelError::TensorParallel(format!(
                        "rank {r} stopped while building its session"
                    ))))
                }
            }
        }
        Ok(s)
    }

    /// Send `cmd` to every rank and wait for all of them; rank 0's logits become this
    /// session's. A rank that fails leaves the group, so the others fail too, not hang.
    fn run(
        &mut self,
        cmd: impl Fn() -> Cmd,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        for (r, rank) in self.ranks.iter().enumerate() {
            rank.tx.send(cmd()).map_err(|_| {
                EngineError::Model(ModelError::TensorParallel(format!("rank {r} has stopped")))
            })?;
        }
        let mut first_err: Option<String> = None;
        for (r, rank) in self.ranks.iter().enumerate() {
            loop {
                match rank.rx.recv() {
                    Ok(Reply::Progress(done, total)) => progress(done, total),
                    Ok(Reply::Logits(l)) => {
                        if r == 0 {
                            self.logits = l;
                        }
                        break;
                    }
                    Ok(Reply::Failed(e)) => {
                        first_err.get_or_insert(format!("rank {r}: {e}"));
                        break;
                    }
                    Ok(Reply::Ready(_)) | Err(_) => {
                        first_err.get_or_insert(format!("rank {r} has stopped"));
                        break;
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(EngineError::Model(ModelError::TensorParallel(e))),
            None => Ok(&self.logits),
        }
    }

    /// Each rank's policy statistics (kv heads of its own), in rank order.
    pub fn rank_stats(&self) -> Vec<PolicyStats> {
        self.ranks
            .iter()
            .map(|r| r.state.lock().map(|s| s.1.clone()).unwrap_or_default())
            .collect()
    }
}

#[allow(clippy::too_many_arguments)]
fn rank_loop(
    r: usize,
    model: Model,
    max_tokens: usize,
    kv: KvDtype,
    chunk: usize,
    policy: PolicySpec,
    cmds: Receiver<Cmd>,
    reply: Sender<Reply>,
    state: Arc<std::sync::Mutex<(usize, PolicyStats)>>,
) {
    let mut sess = match Session::try_with_policy(&model, max_tokens, kv, chunk, &policy) {
        Ok(s) => s,
        Err(e) => {
            let _ = reply.send(Reply::Ready(Err(e)));
            return;
        }
    };
    if reply.send(Reply::Ready(Ok(sess.policy_name()))).is_err() {
        return;
    }
    while let Ok(cmd) = cmds.recv() {
        let out = match cmd {
            Cmd::Prefill(tokens) => {
                let tx = reply.clone();
                sess.prefill(&tokens, &mut |done, total| {
                    if r == 0 {
                        let _ = tx.send(Reply::Progress(done, total));
                    }
                })
                .map(|l| l.to_vec())
            }
            Cmd::Step(t) => sess.step(t).map(|l| l.to_vec()),
        };
        if let Ok(mut s) = state.lock() {
            *s = (sess.kv_bytes(), sess.policy_stats());
        }
        let failed = out.is_err();
        let msg = match out {
            Ok(l) if r == 0 => Reply::Logits(l),
            Ok(_) => Reply::Logits(Vec::new()),
            Err(e) => Reply::Failed(e.to_string()),
        };
        if reply.send(msg).is_err() || failed {
            // Leaving drops this rank's communicator: the other ranks' collectives fail.
            return;
        }
    }
}

impl Drop for TpSession {
    fn drop(&mut self) {
        // Dropping a rank's command sender ends its loop; then wait for every rank.
        let handles: Vec<_> = self
            .ranks
            .drain(..)
            .filter_map(|mut r| r.handle.take())
            .collect();
        for h in handles {
            let _ = h.join();
        }
    }
}

impl crate::device::Steps for TpSession {
    fn prefill(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<&[f32], EngineError> {
        let tokens: Arc<[u32]> = tokens.into();
        self.run(|| Cmd::Prefill(tokens.clone()), progress)
    }
    fn step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.run(|| Cmd::Step(token), &mut |_, _| {})
    }
    fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// KV bytes of all ranks together (a replicated kv head counts once a rank).
    fn kv_bytes(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| r.state.lock().map(|s| s.0).unwrap_or(0))
            .sum()
    }
    fn policy_name(&self) -> &'static str {
        self.policy_name
    }
    /// Steps as rank 0 counts them; keys attended and dense summed over the ranks, so the
    /// retained fraction is over every rank's kv heads.
    fn policy_stats(&self) -> PolicyStats {
        let all = self.rank_stats();
        let mut s = all.first().cloned().unwrap_or_default();
        s.attended_tokens = all.iter().map(|x| x.attended_tokens).sum();
        s.dense_tokens = all.iter().map(|x| x.dense_tokens).sum();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Steps;
    use crate::eval::argmax;
    use crate::session::{policy_spec_with, SfiKnobs};
    use slowfast_quant::GgmlType;

    /// A 4-layer Qwen3-shaped model with 4 query and 4 kv heads and f32 weights (so the
    /// activations stay f32 and ranks differ from the whole model only in summation order).
    fn small() -> Model {
        small_kv(4)
    }

    /// [`small`] with `nkv` kv heads.
    fn small_kv(nkv: usize) -> Model {
        let mut c = slowfast_model::presets::preset("qwen3-0.6b").unwrap();
        c.num_hidden_layers = 4;
        c.layer_sliding = vec![false; 4];
        c.hidden_size = 64;
        c.num_attention_heads = 4;
        c.num_key_value_heads = nkv;
        c.head_dim = 16;
        c.intermediate_size = 128;
        c.vocab_size = 96;
        let w = slowfast_model::random::random_weights(&c, GgmlType::F32, 7).unwrap();
        Model::new(c, w).unwrap()
    }

    /// Prefill `prompt`, then `steps` greedy steps; the tokens and every step's logits.
    fn greedy(s: &mut dyn Steps, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
        let mut next = argmax(s.prefill(prompt, &mut |_, _| {}).unwrap());
        let (mut toks, mut logits) = (vec![next], Vec::new());
        for _ in 0..steps {
            let l = s.step(next).unwrap().to_vec();
            next = argmax(&l);
            toks.push(next);
            logits.push(l);
        }
        (toks, logits)
    }

    fn prompt(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| (i * 37 + 11) % 96).collect()
    }

    fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                d / scale
            })
            .fold(0f32, f32::max)
    }

    #[test]
    fn full_kv_ranks_decode_like_the_whole_model() {
        let m = small();
        let p = prompt(40);
        let mut whole =
            Session::try_with_policy(&m, 80, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
        let (want, want_logits) = greedy(&mut whole, &p, 24);
        for tp in [2, 4] {
            let mut s = TpSession::new(&m, tp, 80, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
            let (got, got_logits) = greedy(&mut s, &p, 24);
            assert_eq!(got, want, "tp {tp}: greedy tokens");
            let d = max_rel_diff(&got_logits, &want_logits);
            assert!(d < 2e-6, "tp {tp}: logits differ by {d} of the largest");
            // Every rank holds the KV of its own kv heads: together the whole model's.
            assert_eq!(s.kv_bytes(), whole.kv_bytes(), "tp {tp}");
        }
    }

    /// SFI runs per rank over the rank's kv heads. With cross-head exclusivity and the
    /// cheaper slow step off the Selector chooses per kv head from that head's query heads, so
    /// the ranks together make the whole model's choices; with exclusivity on (4 kv heads at
    /// TP 1, 2 a rank: skipped there) or the cheaper slow step (its pages are picked over every
    /// query head the rank holds) they may differ, but the schedule stays the same on every
    /// rank.
    #[test]
    fn sfi_per_rank_keeps_one_schedule_and_matches_without_cross_head_exclusivity() {
        let m = small();
        let p = prompt(120);
        let mut knobs = SfiKnobs {
            recent: 16,
            trigger: "periodic".into(),
            refresh_interval: 4,
            candidates: 0.0,
            ..SfiKnobs::default()
        };
        knobs.selector.cross_head_alpha = 0.0;
        let spec = policy_spec_with("sfi", Some(48.0), 4, 160, &knobs).unwrap();
        let mut whole = Session::try_with_policy(&m, 160, KvDtype::F32, 16, &spec).unwrap();
        let (want, want_logits) = greedy(&mut whole, &p, 24);
        let mut s = TpSession::new(&m, 2, 160, KvDtype::F32, 16, &spec).unwrap();
        let (got, got_logits) = greedy(&mut s, &p, 24);
        assert_eq!(got, want);
        let d = max_rel_diff(&got_logits, &want_logits);
        assert!(d < 1e-5, "logits differ by {d} of the largest");
        let ranks = s.rank_stats();
        let w = whole.policy_stats();
        assert!(w.slow_steps >= 5 && w.fast_steps > 0, "{w:?}");
        for r in &ranks {
            assert_eq!((r.slow_steps, r.fast_steps), (w.slow_steps, w.fast_steps));
        }
        let (a, b) = (s.policy_stats().retained_fraction(), w.retained_fraction());
        assert!((a - b).abs() < 1e-9 && a < 1.0, "retained {a} against {b}");

        // Exclusivity on: a different choice is allowed, the schedule is not.
        knobs.selector.cross_head_alpha = 0.85;
        let on = policy_spec_with("sfi", Some(48.0), 4, 160, &knobs).unwrap();
        let mut s = TpSession::new(&m, 2, 160, KvDtype::F32, 16, &on).unwrap();
        greedy(&mut s, &p, 24);
        for r in s.rank_stats() {
            assert_eq!((r.slow_steps, r.fast_steps), (w.slow_steps, w.fast_steps));
        }
    }

    /// One kv head (as Gemma 3 270M) over 2 and 4 ranks: every rank holds it, and its
    /// policy reads the query and captures of all four query heads (gathered), so SFI (dense
    /// and cheaper slow steps) and Quest choose as the whole model does.
    #[test]
    fn a_replicated_kv_head_is_chosen_from_every_query_head() {
        let m = small_kv(1);
        let p = prompt(120);
        let knobs = SfiKnobs {
            recent: 16,
            trigger: "periodic".into(),
            refresh_interval: 4,
            ..SfiKnobs::default()
        };
        let cheap = SfiKnobs {
            candidates: 2.0,
            ..knobs.clone()
        };
        let specs = [
            policy_spec_with("sfi", Some(48.0), 4, 160, &knobs).unwrap(),
            policy_spec_with("sfi", Some(48.0), 4, 160, &cheap).unwrap(),
            policy_spec_with("quest", Some(48.0), 4, 160, &knobs).unwrap(),
        ];
        for spec in &specs {
            let mut whole = Session::try_with_policy(&m, 160, KvDtype::F32, 16, spec).unwrap();
            let (want, want_logits) = greedy(&mut whole, &p, 24);
            let w = whole.policy_stats();
            assert!(w.retained_fraction() < 0.9, "{}: {w:?}", spec.name());
            for tp in [2, 4] {
                let mut s = TpSession::new(&m, tp, 160, KvDtype::F32, 16, spec).unwrap();
                let (got, got_logits) = greedy(&mut s, &p, 24);
                assert_eq!(got, want, "{} at tp {tp}", spec.name());
                let d = max_rel_diff(&got_logits, &want_logits);
                assert!(d < 1e-5, "{} at tp {tp}: logits differ by {d}", spec.name());
                for r in s.rank_stats() {
                    assert_eq!((r.slow_steps, r.fast_steps), (w.slow_steps, w.fast_steps));
                    let (a, b) = (r.retained_fraction(), w.retained_fraction());
                    assert!(
                        (a - b).abs() < 1e-9,
                        "{} at tp {tp}: {a} against {b}",
                        spec.name()
                    );
                }
            }
        }
    }

    #[test]
    fn bad_splits_and_failing_steps_are_errors_not_hangs() {
        let m = small();
        let e = TpSession::new(&m, 3, 80, KvDtype::F32, 16, &PolicySpec::Full)
            .err()
            .expect("4 heads over 3 ranks");
        assert!(e.to_string().contains("--tensor-parallel 3"), "{e}");
        // A step past the capacity fails on every rank; the session reports it.
        let mut s = TpSession::new(&m, 2, 8, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
        s.prefill(&prompt(8), &mut |_, _| {}).unwrap();
        let e = s.step(1).expect_err("past the capacity");
        assert!(e.to_string().contains("rank"), "{e}");
        // And the next call says the ranks have stopped instead of waiting for them.
        assert!(s.step(1).is_err());
    }
}
