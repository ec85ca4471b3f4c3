//! slowfast-engine (skeleton; filled in by its owner).
