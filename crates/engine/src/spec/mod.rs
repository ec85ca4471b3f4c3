//! Speculative decoding: the draft–verify loop (`speculator`), the acceptance arithmetic
//! (`sample`), the n-gram drafter (`ngram`) and its timing with a replayed acceptance
//! (`replay`, `timing`).
pub mod ngram;
pub mod replay;
pub mod sample;
pub mod speculator;
pub mod target;
pub mod timing;

pub use speculator::{
    check_same_vocab, DraftKind, Row, SpecOptions, SpecReport, SpecStats, SpecTokens, Speculator,
    MAX_SPEC_TOKENS,
};
pub use target::{spec_session, SpecSession, SpecTarget};
