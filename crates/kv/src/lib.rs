//! slowfast-kv: the KV store (preallocated, written in place) and, on top of it, the KV
//! policies that decide what each decode step attends to.
pub mod sfi;
pub mod store;

pub use store::{CacheElem, KvError, KvStore, LayerKv, LayerSpec};
