//! slowfast-backend: compute kernels. `cpu` holds the CPU kernels (attention, elementwise ops).
pub mod cpu;
