//! Speculative decoding's pure parts: the acceptance arithmetic and the n-gram drafter.
pub mod ngram;
pub mod sample;
