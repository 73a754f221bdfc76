//! What the user chooses in the settings window, kept on disk as JSON, and turned into the edge
//! library's [`ClientOptions`]. The API key is not among them: it lives in the OS keyring (or a
//! file only the user can read), see [`crate::secret`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use specinfer_edge::{
    catalogue_model, ClientOptions, Decoding, DraftBackend, LlmChoice, VerifierChoice, CATALOGUE,
};
use specinfer_net::Trust;

/// Where the verifier is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum VerifierSetting {
    /// In this process (the LLM runs here too): nothing to set up.
    Embedded,
    Remote {
        /// HOST:PORT, or several comma-separated (a fleet).
        servers: String,
        /// The name the certificate must carry (ignored when pinning).
        server_name: String,
        trust: TrustSetting,
    },
}

/// How a remote verifier's certificate is checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TrustSetting {
    /// The certificate's SHA-256 fingerprint, as `specinfer-verifier certificate` prints it.
    Pin(String),
    /// CA certificates (PEM) that sign the verifier's certificate.
    Ca(PathBuf),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    Candle,
    Onnx,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub verifier: VerifierSetting,
    /// The LLM: a catalogue name (`smollm2-135m`, `qwen2.5-coder-1.5b`: fetched on first use)
    /// or a GGUF file's path.
    pub llm: String,
    /// The draft model: an SSM folder, a GGUF file, or "self"; empty: the LLM's own (its
    /// catalogue entry's).
    pub draft: String,
    pub backend: Backend,
    /// `auto`, `none` or a tree shape (see `specinfer --help`).
    pub tree: String,
    /// Greedy decoding (token-identical to the LLM alone); else sampling at the settings below.
    pub greedy: bool,
    pub temperature: f32,
    pub top_p: f32,
    /// `None`: every answer gets a fresh seed.
    pub seed: Option<u64>,
    pub max_tokens: u32,
}

impl Default for Settings {
    /// The chat defaults: sampling at llama.cpp's temperature 0.8 and top-p 0.95, since a small
    /// model decoded greedily soon repeats itself; the embedded verifier; the shipped SSM.
    fn default() -> Self {
        Settings {
            verifier: VerifierSetting::Embedded,
            llm: CATALOGUE[0].name.into(),
            draft: String::new(),
            backend: Backend::Candle,
            tree: "auto".into(),
            greedy: false,
            temperature: 0.8,
            top_p: 0.95,
            seed: None,
            max_tokens: 256,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    /// A setting that cannot work; the message says which and why.
    #[error("{0}")]
    Invalid(String),
}

impl Settings {
    /// The settings saved in `path`; the defaults when there are none yet.
    pub fn load(path: &Path) -> Result<Settings, SettingsError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Settings::default()),
            Err(e) => return Err(file_error(path, e)),
        };
        serde_json::from_str(&text).map_err(|e| file_error(path, e))
    }

    pub fn save(&self, path: &Path) -> Result<(), SettingsError> {
        let json = serde_json::to_string_pretty(self).expect("settings serialise");
        crate::store::write_atomically(path, json.as_bytes()).map_err(|e| file_error(path, e))
    }

    /// The edge library's options for these settings, with `api_key` for a remote verifier.
    pub fn options(&self, api_key: Option<String>) -> Result<ClientOptions, SettingsError> {
        let invalid = |m: &str| SettingsError::Invalid(m.into());
        // Written so that a NaN temperature is refused too.
        if !self.greedy && self.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(invalid(
                "the temperature must be positive when sampling (choose greedy to decode greedily)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top-p must be in (0, 1]"));
        }
        if self.max_tokens == 0 {
            return Err(invalid("the answer length must be at least one token"));
        }
        specinfer_edge::setup::parse_tree(&self.tree)
            .map_err(|e| SettingsError::Invalid(format!("tree: {e}")))?;
        let verifier = match &self.verifier {
            VerifierSetting::Embedded => VerifierChoice::Embedded,
            VerifierSetting::Remote {
                servers,
                server_name,
                trust,
            } => {
                if servers.trim().is_empty() {
                    return Err(invalid("give the verifier's address (HOST:PORT)"));
                }
                VerifierChoice::Remote {
                    server: servers.trim().to_string(),
                    server_name: server_name.trim().to_string(),
                    trust: match trust {
                        TrustSetting::Pin(pin) => Trust::pinned_hex(pin.trim())
                            .map_err(|e| SettingsError::Invalid(format!("pin: {e}")))?,
                        TrustSetting::Ca(path) => Trust::Roots(path.clone()),
                    },
                    api_key: api_key.filter(|k| !k.is_empty()),
                }
            }
        };
        let llm = match self.llm.trim() {
            name if name.ends_with(".gguf") => LlmChoice::File(PathBuf::from(name)),
            name => LlmChoice::Catalogue(
                catalogue_model(name).map_err(|e| SettingsError::Invalid(format!("LLM: {e}")))?,
            ),
        };
        let draft = self.draft.trim();
        Ok(ClientOptions {
            verifier,
            llm,
            ssms: if draft.is_empty() {
                Vec::new()
            } else {
                vec![draft.to_string()]
            },
            backend: match self.backend {
                Backend::Candle => DraftBackend::Candle,
                Backend::Onnx => DraftBackend::Onnx,
            },
            tree: self.tree.trim().to_string(),
            decoding: if self.greedy {
                Decoding::Greedy
            } else {
                Decoding::Sample {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: 0,
                    seed: self.seed,
                }
            },
            max_tokens: self.max_tokens,
            ..ClientOptions::default()
        })
    }
}

fn file_error(path: &Path, e: impl std::fmt::Display) -> SettingsError {
    SettingsError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_survive_a_round_trip_and_missing_fields_take_defaults() {
        let scratch = crate::store::tests::scratch_dir("settings");
        let dir = scratch.path();
        let path = dir.join("settings.json");
        assert_eq!(Settings::load(&path).unwrap(), Settings::default());
        let s = Settings {
            verifier: VerifierSetting::Remote {
                servers: "a:4433,b:4433".into(),
                server_name: "verifier".into(),
                trust: TrustSetting::Pin("ab".repeat(32)),
            },
            greedy: true,
            seed: Some(7),
            ..Settings::default()
        };
        s.save(&path).unwrap();
        assert_eq!(Settings::load(&path).unwrap(), s);
        std::fs::write(&path, r#"{"greedy": true}"#).unwrap();
        let partial = Settings::load(&path).unwrap();
        assert!(partial.greedy);
        assert_eq!(partial.max_tokens, Settings::default().max_tokens);
        std::fs::write(&path, "{not json").unwrap();
        assert!(matches!(
            Settings::load(&path),
            Err(SettingsError::File { .. })
        ));
    }

    #[test]
    fn impossible_settings_are_refused_in_words() {
        let bad_pin = Settings {
            verifier: VerifierSetting::Remote {
                servers: "127.0.0.1:4433".into(),
                server_name: "localhost".into(),
                trust: TrustSetting::Pin("not hex".into()),
            },
            ..Settings::default()
        };
        let e = bad_pin.options(None).unwrap_err().to_string();
        assert!(e.starts_with("pin:"), "{e}");
        let cold = Settings {
            temperature: 0.0,
            ..Settings::default()
        };
        assert!(cold
            .options(None)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        let tree = Settings {
            tree: "sideways".into(),
            ..Settings::default()
        };
        assert!(tree
            .options(None)
            .unwrap_err()
            .to_string()
            .starts_with("tree:"));
        let llm = Settings {
            llm: "gpt-17".into(),
            ..Settings::default()
        };
        let e = llm.options(None).unwrap_err().to_string();
        assert!(
            e.starts_with("LLM:") && e.contains("qwen2.5-coder-1.5b"),
            "{e}"
        );
        let own = Settings {
            llm: "qwen2.5-coder-1.5b".into(),
            ..Settings::default()
        }
        .options(None)
        .unwrap();
        assert!(own.ssms.is_empty(), "the LLM's own drafter: {:?}", own.ssms);
        assert!(matches!(own.llm, LlmChoice::Catalogue(m) if m.name == "qwen2.5-coder-1.5b"));
        let file = Settings {
            llm: "/models/mine.gguf".into(),
            ..Settings::default()
        }
        .options(None)
        .unwrap();
        assert!(matches!(file.llm, LlmChoice::File(p) if p == Path::new("/models/mine.gguf")));
        let ok = Settings::default().options(None).unwrap();
        assert!(matches!(ok.decoding, Decoding::Sample { temperature, .. } if temperature == 0.8));
    }
}
