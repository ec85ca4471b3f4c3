//! Paged KV bookkeeping, shared by the devices: a pool of fixed-size blocks with reference
//! counts ([`BlockPool`]), a hash-chain index of the blocks holding prompt prefixes
//! ([`PrefixCache`]), and the CPU's store of those blocks' KV ([`PrefixKv`]).
mod host;
mod pool;
mod prefix;

pub use host::PrefixKv;
pub use pool::{BlockId, BlockPool, PoolError};
pub use prefix::{block_hash, root_hash, Found, PrefixCache, PrefixStats};
