//! SFI (Slow-Fast Inference) KV policy parts: the training-free Selector that refreshes the
//! sparse memory at slow steps, and the slow-step trigger.
pub mod selector;
mod selector_math;
pub mod selector_ref;
#[cfg(test)]
mod selector_tests;
pub mod trigger;
