//! The protections every tool gets for free: result caps, capped upstream bodies, and the
//! translation of every failure into a sentence the model can act on.

pub mod caps;
pub mod errors;

pub use errors::ToolError;
