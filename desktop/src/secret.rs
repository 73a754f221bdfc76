//! The verifier's API key, kept out of the settings file: in the OS keyring (Keychain, Windows
//! Credential Manager, the Secret Service) where there is one, else in a file only the user can
//! read (mode 0600 on Unix).

use std::path::PathBuf;

const SERVICE: &str = "specinfer-desktop";
const ACCOUNT: &str = "verifier-api-key";

/// Where the key is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyPlace {
    Keyring,
    File(PathBuf),
}

impl std::fmt::Display for KeyPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyPlace::Keyring => f.write_str("the system keyring"),
            KeyPlace::File(p) => write!(f, "{} (readable only by you)", p.display()),
        }
    }
}

pub struct ApiKeyStore {
    file: PathBuf,
    use_keyring: bool,
}

impl ApiKeyStore {
    /// The keyring first, `file` where there is no keyring.
    pub fn system(file: PathBuf) -> ApiKeyStore {
        ApiKeyStore {
            file,
            use_keyring: true,
        }
    }

    /// `file` only (`--no-keyring`: machines whose keyring prompts, or that have none).
    pub fn file_only(file: PathBuf) -> ApiKeyStore {
        ApiKeyStore {
            file,
            use_keyring: false,
        }
    }

    fn entry(&self) -> Option<keyring::Entry> {
        if !self.use_keyring {
            return None;
        }
        keyring::Entry::new(SERVICE, ACCOUNT).ok()
    }

    /// The saved key, if any.
    pub fn load(&self) -> Option<String> {
        if let Some(entry) = self.entry() {
            match entry.get_password() {
                Ok(key) => return Some(key),
                Err(keyring::Error::NoEntry) => {}
                Err(e) => tracing::debug!("no keyring ({e}); reading {}", self.file.display()),
            }
        }
        std::fs::read_to_string(&self.file)
            .ok()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
    }

    /// Saves `key` (an empty key forgets it); says where it went.
    pub fn save(&self, key: &str) -> std::io::Result<KeyPlace> {
        if key.is_empty() {
            if let Some(entry) = self.entry() {
                let _ = entry.delete_credential();
            }
            match std::fs::remove_file(&self.file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => return Ok(KeyPlace::File(self.file.clone())),
            }
        }
        if let Some(entry) = self.entry() {
            match entry.set_password(key) {
                Ok(()) => {
                    // A key left in the file from before would be read where the keyring is
                    // missing later; it is the keyring's now.
                    let _ = std::fs::remove_file(&self.file);
                    return Ok(KeyPlace::Keyring);
                }
                Err(e) => tracing::info!(
                    "no system keyring ({e}); keeping the API key in {}",
                    self.file.display()
                ),
            }
        }
        write_private(&self.file, key.as_bytes())?;
        Ok(KeyPlace::File(self.file.clone()))
    }
}

/// Writes `bytes` to `path`, readable and writable by its owner only (created so: there is no
/// moment at which others could read it).
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_in_a_file_is_readable_only_by_its_owner_and_can_be_forgotten() {
        let scratch = crate::store::tests::scratch_dir("secret");
        let dir = scratch.path();
        let file = dir.join("api-key");
        let store = ApiKeyStore::file_only(file.clone());
        assert_eq!(store.load(), None);
        assert_eq!(store.save("s3cret").unwrap(), KeyPlace::File(file.clone()));
        assert_eq!(store.load().as_deref(), Some("s3cret"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
        }
        store.save("other").unwrap();
        assert_eq!(store.load().as_deref(), Some("other"));
        store.save("").unwrap();
        assert_eq!(store.load(), None);
        assert!(!file.exists());
    }
}
