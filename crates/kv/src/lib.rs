//! slowfast-kv: the KV store (preallocated, written in place) and, on top of it, the KV
//! policies that decide what each decode step attends to.
pub mod policy;
pub mod probe;
pub mod sfi;
pub mod store;
pub mod streaming;

pub use policy::{AttnCall, FullPolicy, KvPolicy, PolicyStats, StepCounter};
pub use store::{CacheElem, KvError, KvStore, LayerKv, LayerSpec};
pub use streaming::StreamingPolicy;
