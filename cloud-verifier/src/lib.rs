//! The cloud verifier: decides which speculated tokens the LLM keeps.

pub mod verify;
