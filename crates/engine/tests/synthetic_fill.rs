//! `Session::fill_synthetic` (benchmarks at long contexts): it fills exactly the requested
//! positions, a real prefill continues after them, and bad requests are errors.
use std::path::PathBuf;

use slowfast_engine::{KvDtype, PolicySpec, Session};
use slowfast_model::load::{load_model, ModelSource};

#[test]
fn synthetic_prefix_then_real_tokens() {
    // The Gemma 3 fixture has sliding-window (ring) layers: the fill must wrap them too.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/gemma3");
    let m = load_model(&ModelSource::HfDir(dir)).unwrap();
    let mut s = Session::try_with_policy(&m, 200, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
    s.fill_synthetic(150, 7).unwrap();
    assert_eq!(s.pos(), 150);
    let l = s.prefill(&[5, 6, 7, 8], &mut |_, _| {}).unwrap().to_vec();
    assert_eq!(s.pos(), 154);
    assert!(l.iter().all(|x| x.is_finite()));

    // Same seed, same cache, same logits; another seed changes them (the keys are attended).
    let mut a = Session::try_with_policy(&m, 200, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
    a.fill_synthetic(150, 7).unwrap();
    assert_eq!(a.prefill(&[5, 6, 7, 8], &mut |_, _| {}).unwrap(), &l[..]);
    let mut b = Session::try_with_policy(&m, 200, KvDtype::F32, 16, &PolicySpec::Full).unwrap();
    b.fill_synthetic(150, 8).unwrap();
    assert_ne!(b.prefill(&[5, 6, 7, 8], &mut |_, _| {}).unwrap(), &l[..]);

    // A non-empty cache or a fill past the capacity is refused.
    let e = s.fill_synthetic(10, 1).unwrap_err().to_string();
    assert!(e.contains("empty cache"), "{e}");
    let mut c = Session::try_with_policy(&m, 100, KvDtype::F16, 16, &PolicySpec::Full).unwrap();
    let e = c.fill_synthetic(101, 1).unwrap_err().to_string();
    assert!(e.contains("exceeds the cache capacity"), "{e}");
}
