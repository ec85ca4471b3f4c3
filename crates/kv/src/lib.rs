//! slowfast-kv (skeleton; filled in by its owner).
