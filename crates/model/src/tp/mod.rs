//! Tensor parallelism, device-neutral: the partition of a model over ranks (`plan`), a rank's
//! weights (`shard`) and the collectives between ranks (`comm`). The decoder calls the
//! communicator after its row-parallel products, the embedding and the LM head.
mod comm;
mod plan;
mod shard;
mod share;
#[cfg(test)]
mod tests;

pub use comm::{Communicator, SingleRank, ThreadGroup};
pub(crate) use plan::on_blocks;
pub use plan::{RankSlice, TpPlan};
pub use shard::shard;
pub use share::KvShare;
