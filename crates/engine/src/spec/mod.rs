//! Speculative decoding: the draft–verify loop (`speculator`), the acceptance arithmetic
//! (`sample`) and the n-gram drafter (`ngram`).
pub mod ngram;
pub mod replay;
pub mod sample;
pub mod speculator;
pub mod target;

pub use speculator::{
    check_same_vocab, DraftKind, SpecOptions, SpecReport, SpecStats, SpecTokens, Speculator,
    MAX_SPEC_TOKENS,
};
pub use target::{spec_session, SpecSession, SpecTarget};
