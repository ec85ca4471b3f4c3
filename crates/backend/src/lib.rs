//! slowfast-backend (skeleton; filled in by its owner).
