//! slowfast-model (skeleton; filled in by its owner).
