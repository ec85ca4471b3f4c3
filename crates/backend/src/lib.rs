//! slowfast-backend: compute kernels. `cpu` holds the CPU kernels (attention, elementwise ops);
//! `e4m3` the fp8 format both devices' KV caches use.
pub mod cpu;
pub mod e4m3;
