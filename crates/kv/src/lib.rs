//! slowfast-kv: the KV store (preallocated, written in place, compactable per kv head) and, on
//! top of it, the KV policies that decide what each step attends to and what is kept.
pub mod h2o;
pub mod inspect;
pub mod oracle;
pub mod paged;
pub mod policy;
pub mod probe;
pub mod pyramid;
pub mod quest;
pub mod score;
pub mod sfi;
pub mod snapkv;
pub mod store;
pub mod streaming;

pub use h2o::H2oPolicy;
pub use inspect::{Held, SlowLog, SlowReason, SlowStep};
pub use oracle::{OracleConfig, OraclePolicy, OracleRule};
pub use policy::{AttnCall, FullPolicy, KvPolicy, PolicyStats, StepCounter};
pub use quest::QuestPolicy;
pub use snapkv::{SnapKvConfig, SnapKvPolicy};
pub use store::{
    block_slots, CacheElem, E4m3, HeadRows, KvBlock, KvError, KvStore, LayerKv, LayerSpec,
    KV_BLOCK, KV_GROW,
};
pub use streaming::StreamingPolicy;
