//! CPU kernels: attention (tiled online softmax) and elementwise ops.
pub mod attention;
pub mod ops;
