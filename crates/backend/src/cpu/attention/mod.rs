//! CPU attention kernels (owned by the attention work; skeleton).
