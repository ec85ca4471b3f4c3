//! slowfast-tokenizer (skeleton; filled in by its owner).
