//! slowfast-quant (skeleton; filled in by its owner).
