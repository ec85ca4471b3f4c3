//! slowfast-loader (skeleton; filled in by its owner).
