//! Token sampling (skeleton).
