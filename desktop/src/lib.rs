//! `specinfer-desktop`: a chat window over the edge client. Conversations are kept on disk,
//! answers stream in as the verifier accepts them, and a side panel shows what speculation does
//! for each answer. The models, the verifier and the generation all come from
//! `specinfer_edge::ClientSetup`, as for the CLI and the OpenAI endpoint.

pub mod app;
pub mod explain;
pub mod secret;
pub mod settings;
pub mod stats;
pub mod store;
pub mod worker;

pub use app::{AppConfig, DesktopApp, Status};
