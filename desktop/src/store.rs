//! Conversations on disk: one JSON file each in the app's data folder, written atomically (a
//! temporary file renamed over the old one), so a crash mid-write never leaves half a file. A
//! file that does not parse is reported and skipped; it is left where it is, and the others load.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::stats::AnswerStats;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    /// The chat template's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// What speculation did for this answer (assistant messages).
    #[serde(default)]
    pub stats: Option<AnswerStats>,
    /// The answer was stopped before the model finished it.
    #[serde(default)]
    pub stopped: bool,
}

impl Message {
    pub fn user(content: &str) -> Message {
        Message {
            role: Role::User,
            content: content.into(),
            stats: None,
            stopped: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    /// Also the file's name: the creation time in milliseconds, made unique in the folder.
    pub id: String,
    pub title: String,
    pub messages: Vec<Message>,
    /// Plain decoding's tokens per second measured in this conversation (for the speed-up).
    #[serde(default)]
    pub plain_tokens_per_s: Option<f64>,
}

impl Conversation {
    pub const UNTITLED: &'static str = "New conversation";

    /// The title a conversation takes from its first question.
    pub fn title_from(question: &str) -> String {
        let line = question.lines().next().unwrap_or("").trim();
        let mut title: String = line.chars().take(40).collect();
        if line.chars().count() > 40 {
            title.push('…');
        }
        if title.is_empty() {
            Self::UNTITLED.into()
        } else {
            title
        }
    }
}

/// A file that could not be loaded, and why.
#[derive(Clone, Debug)]
pub struct LoadProblem {
    pub path: PathBuf,
    pub message: String,
}

impl std::fmt::Display for LoadProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} could not be read and was skipped: {}",
            self.path.display(),
            self.message
        )
    }
}

/// The conversations folder.
pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn open(dir: PathBuf) -> std::io::Result<Store> {
        std::fs::create_dir_all(&dir)?;
        Ok(Store { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every conversation that loads, newest first, and the files that did not.
    pub fn load_all(&self) -> (Vec<Conversation>, Vec<LoadProblem>) {
        let mut conversations = Vec::new();
        let mut problems = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) => {
                problems.push(LoadProblem {
                    path: self.dir.clone(),
                    message: e.to_string(),
                });
                return (conversations, problems);
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let loaded = std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<Conversation>(&t).map_err(|e| e.to_string()));
            match loaded {
                Ok(c) if Some(c.id.as_str()) == path.file_stem().and_then(|s| s.to_str()) => {
                    conversations.push(c)
                }
                Ok(c) => problems.push(LoadProblem {
                    path,
                    message: format!("it holds conversation {:?}, not its namesake", c.id),
                }),
                Err(message) => problems.push(LoadProblem { path, message }),
            }
        }
        conversations.sort_by(|a, b| b.id.cmp(&a.id));
        (conversations, problems)
    }

    /// A new, empty conversation with an id no file in the folder has.
    pub fn create(&self) -> Conversation {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut n = 0;
        let id = loop {
            let id = format!("{now:015}-{n}");
            if !self.path(&id).exists() {
                break id;
            }
            n += 1;
        };
        Conversation {
            id,
            title: Conversation::UNTITLED.into(),
            messages: Vec::new(),
            plain_tokens_per_s: None,
        }
    }

    pub fn save(&self, c: &Conversation) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(c).expect("conversations serialise");
        write_atomically(&self.path(&c.id), json.as_bytes())
    }

    pub fn delete(&self, id: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }
}

/// Writes `bytes` to a temporary file beside `path`, flushes it to disk and renames it over
/// `path`: readers see the old contents or the new, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An empty folder of its own under the system's temporary folder, removed when dropped.
    pub(crate) fn scratch_dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("specinfer-desktop-{name}-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn conversations_survive_reopening_and_a_corrupt_file_costs_only_itself() {
        let scratch = scratch_dir("store");
        let dir = scratch.path().to_path_buf();
        let store = Store::open(dir.clone()).unwrap();
        let mut first = store.create();
        first.messages.push(Message::user("hello"));
        store.save(&first).unwrap();
        let mut second = store.create();
        assert_ne!(first.id, second.id);
        second.title = "second".into();
        store.save(&second).unwrap();
        std::fs::write(dir.join("999-broken.json"), "{\"id\": ").unwrap();
        std::fs::write(dir.join("notes.txt"), "not a conversation").unwrap();

        let reopened = Store::open(dir.clone()).unwrap();
        let (loaded, problems) = reopened.load_all();
        assert_eq!(loaded.len(), 2);
        assert!(loaded.contains(&first) && loaded.contains(&second));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].path.ends_with("999-broken.json"));
        assert!(
            dir.join("999-broken.json").exists(),
            "a corrupt file is left for the user to recover"
        );

        reopened.delete(&first.id).unwrap();
        assert_eq!(reopened.load_all().0, vec![second]);
    }

    #[test]
    fn a_title_is_the_first_line_of_the_question_cut_short() {
        assert_eq!(Conversation::title_from("Hi there\nmore"), "Hi there");
        let long = "x".repeat(60);
        assert_eq!(Conversation::title_from(&long).chars().count(), 41);
        assert_eq!(Conversation::title_from("  "), Conversation::UNTITLED);
    }
}
