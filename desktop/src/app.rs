//! The window: conversations on the left, the transcript in the middle with the composer below
//! it, what speculation does on the right, the status line on top, settings in their own window.
//! Nothing here waits: slow work goes to the [`Worker`], whose events are taken at each frame.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use egui::{Color32, RichText};
use egui_commonmark::{CommonMarkCache, CommonMarkViewer};
use specinfer_model::ChatMessage;

use crate::explain::UiError;
use crate::secret::ApiKeyStore;
use crate::settings::{Backend, Settings, TrustSetting, VerifierSetting};
use crate::stats::AnswerStats;
use crate::store::{Conversation, Message, Role, Store};
use crate::worker::{Command, Event, GenerateRequest, Worker};

/// Where the app keeps its files, and how.
#[derive(Clone, Debug)]
pub struct AppConfig {
    /// Conversations, settings and (without a keyring) the API key.
    pub data_dir: PathBuf,
    /// Keep the API key in the OS keyring where there is one.
    pub keyring: bool,
}

impl AppConfig {
    /// The platform's data folder (`~/.local/share/specinfer` on Linux, `~/Library/Application
    /// Support/dev.specinfer.specinfer` on macOS, `%APPDATA%\specinfer` on Windows).
    pub fn platform_default() -> Option<AppConfig> {
        let dirs = directories::ProjectDirs::from("dev", "specinfer", "specinfer")?;
        Some(AppConfig {
            data_dir: dirs.data_dir().to_path_buf(),
            keyring: true,
        })
    }
}

/// The setup's state, as the status line shows it.
#[derive(Clone, Debug)]
pub enum Status {
    SettingUp { line: String, fraction: Option<f32> },
    Ready(String),
    Failed(UiError),
}

/// An answer being generated.
struct Answering {
    conversation: String,
    stop: Arc<AtomicBool>,
    text: String,
    stats: AnswerStats,
}

/// An error shown in the window, and what its Retry does.
#[derive(Clone, Debug)]
pub struct Failure {
    pub error: UiError,
    retry: Retry,
}

#[derive(Clone, Copy, Debug)]
enum Retry {
    /// Set up again with the current settings.
    Setup,
    /// Ask the current conversation's last question again.
    Answer,
}

/// The settings window's working copy.
struct SettingsForm {
    settings: Settings,
    /// Edited apart from the settings: it is stored in the keyring, not with them.
    api_key: String,
    remote: bool,
    /// The remote verifier's fields, kept while "embedded" is chosen.
    servers: String,
    server_name: String,
    pin: String,
    ca: String,
    use_ca: bool,
    seed: String,
    error: Option<String>,
}

pub struct DesktopApp {
    worker: Worker,
    /// The window's context, for the worker to wake it (known from the first frame on).
    repaint: Arc<OnceLock<egui::Context>>,
    store: Store,
    settings: Settings,
    settings_path: PathBuf,
    keys: ApiKeyStore,
    conversations: Vec<Conversation>,
    /// Index into `conversations`; `None`: a new conversation starts with the next question.
    current: Option<usize>,
    /// Things the user should know that are not errors (a skipped file, trimmed history).
    notices: Vec<String>,
    input: String,
    status: Status,
    answering: Option<Answering>,
    failure: Option<Failure>,
    form: Option<SettingsForm>,
    markdown: CommonMarkCache,
    focus_input: bool,
}

const INPUT_ID: &str = "prompt";

impl DesktopApp {
    /// Opens the data folder, loads the conversations and settings, and starts setting up.
    pub fn new(config: AppConfig) -> anyhow::Result<DesktopApp> {
        let store = Store::open(config.data_dir.join("conversations"))?;
        let (conversations, problems) = store.load_all();
        let mut notices: Vec<String> = problems.iter().map(ToString::to_string).collect();
        let settings_path = config.data_dir.join("settings.json");
        let settings = Settings::load(&settings_path).unwrap_or_else(|e| {
            notices.push(format!("{e}; using the default settings"));
            Settings::default()
        });
        let key_file = config.data_dir.join("api-key");
        let keys = if config.keyring {
            ApiKeyStore::system(key_file)
        } else {
            ApiKeyStore::file_only(key_file)
        };
        let repaint: Arc<OnceLock<egui::Context>> = Arc::default();
        let wake = repaint.clone();
        let worker = Worker::start(move || {
            if let Some(ctx) = wake.get() {
                ctx.request_repaint();
            }
        });
        let mut app = DesktopApp {
            worker,
            repaint,
            store,
            settings,
            settings_path,
            keys,
            current: (!conversations.is_empty()).then_some(0),
            conversations,
            notices,
            input: String::new(),
            status: Status::SettingUp {
                line: "starting".into(),
                fraction: None,
            },
            answering: None,
            failure: None,
            form: None,
            markdown: CommonMarkCache::default(),
            focus_input: true,
        };
        app.configure();
        Ok(app)
    }

    pub fn status(&self) -> &Status {
        &self.status
    }

    pub fn is_ready(&self) -> bool {
        matches!(self.status, Status::Ready(_))
    }

    pub fn is_answering(&self) -> bool {
        self.answering.is_some()
    }

    /// The text of the answer being generated, so far.
    pub fn answer_in_progress(&self) -> Option<&str> {
        self.answering.as_ref().map(|a| a.text.as_str())
    }

    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }

    pub fn notices(&self) -> &[String] {
        &self.notices
    }

    pub fn conversations(&self) -> &[Conversation] {
        &self.conversations
    }

    /// The conversation shown, if any.
    pub fn current(&self) -> Option<&Conversation> {
        self.current.map(|i| &self.conversations[i])
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Saves `settings` (and `api_key` where keys are kept) and sets up again with them.
    pub fn apply_settings(&mut self, settings: Settings, api_key: &str) -> Result<(), String> {
        settings
            .options(Some(api_key.to_string()))
            .map_err(|e| e.to_string())?;
        settings
            .save(&self.settings_path)
            .map_err(|e| e.to_string())?;
        match self.keys.save(api_key) {
            Ok(place) if !api_key.is_empty() => self
                .notices
                .push(format!("The API key is kept in {place}.")),
            Ok(_) => {}
            Err(e) => return Err(format!("saving the API key: {e}")),
        }
        self.settings = settings;
        self.configure();
        Ok(())
    }

    fn configure(&mut self) {
        match self.settings.options(self.keys.load()) {
            Ok(options) => {
                self.status = Status::SettingUp {
                    line: "setting up".into(),
                    fraction: None,
                };
                self.worker.send(Command::Configure(Box::new(options)));
            }
            Err(e) => {
                let error = UiError::new("These settings cannot work:", e.to_string());
                self.status = Status::Failed(error.clone());
                self.failure = Some(Failure {
                    error,
                    retry: Retry::Setup,
                });
            }
        }
    }

    /// Takes what the worker has sent since the last frame.
    fn take_events(&mut self) {
        while let Some(event) = self.worker.try_recv() {
            match event {
                Event::Progress { line, fraction } => {
                    self.status = Status::SettingUp { line, fraction }
                }
                Event::Ready(line) => {
                    self.status = Status::Ready(line);
                    if matches!(self.failure, Some(Failure { retry: Retry::Setup, .. })) {
                        self.failure = None;
                    }
                }
                Event::SetupFailed(error) => {
                    self.status = Status::Failed(error.clone());
                    self.failure = Some(Failure {
                        error,
                        retry: Retry::Setup,
                    });
                }
                Event::Forgot {
                    conversation,
                    messages,
                } => self.notices.push(format!(
                    "The {messages} oldest messages of {:?} were left out to fit the model's context.",
                    self.title_of(&conversation)
                )),
                Event::Text {
                    conversation,
                    text,
                    stats,
                } => {
                    if let Some(a) = self
                        .answering
                        .as_mut()
                        .filter(|a| a.conversation == conversation)
                    {
                        a.text.push_str(&text);
                        a.stats = stats;
                    }
                }
                Event::Done {
                    conversation,
                    text,
                    stats,
                    stopped,
                } => {
                    self.answering = None;
                    self.update_conversation(&conversation, |c| {
                        c.messages.push(Message {
                            role: Role::Assistant,
                            content: text,
                            stats: Some(stats),
                            stopped,
                        })
                    });
                }
                Event::Failed {
                    conversation,
                    error,
                } => {
                    if self
                        .answering
                        .as_ref()
                        .is_some_and(|a| a.conversation == conversation)
                    {
                        self.answering = None;
                    }
                    self.failure = Some(Failure {
                        error,
                        retry: Retry::Answer,
                    });
                }
                Event::PlainMeasured {
                    conversation,
                    tokens_per_s,
                } => self.update_conversation(&conversation, |c| {
                    c.plain_tokens_per_s = Some(tokens_per_s)
                }),
            }
        }
    }

    fn title_of(&self, id: &str) -> String {
        self.conversations
            .iter()
            .find(|c| c.id == id)
            .map_or_else(String::new, |c| c.title.clone())
    }

    /// Changes the conversation `id` (if it is still there) and saves it.
    fn update_conversation(&mut self, id: &str, change: impl FnOnce(&mut Conversation)) {
        let Some(c) = self.conversations.iter_mut().find(|c| c.id == id) else {
            return;
        };
        change(c);
        if let Err(e) = self.store.save(c) {
            self.notices.push(format!(
                "The conversation {:?} could not be saved: {e}",
                c.title
            ));
        }
    }

    /// Sends the composer's text as the next question.
    pub fn send(&mut self) {
        let question = self.input.trim().to_string();
        if question.is_empty() || self.answering.is_some() || !self.is_ready() {
            return;
        }
        let index = match self.current {
            Some(i) => i,
            None => {
                self.conversations.insert(0, self.store.create());
                0
            }
        };
        self.current = Some(index);
        let id = self.conversations[index].id.clone();
        self.update_conversation(&id, |c| {
            if c.messages.is_empty() {
                c.title = Conversation::title_from(&question);
            }
            c.messages.push(Message::user(&question));
        });
        self.input.clear();
        self.ask();
    }

    /// Asks the current conversation's last question (again).
    fn ask(&mut self) {
        let Some(c) = self.current() else { return };
        if c.messages.last().map(|m| m.role) != Some(Role::User) {
            return;
        }
        let history = c
            .messages
            .iter()
            .map(|m| ChatMessage::new(m.role.as_str(), &m.content))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let conversation = c.id.clone();
        self.worker.send(Command::Generate(GenerateRequest {
            conversation: conversation.clone(),
            history,
            stop: stop.clone(),
            measure_plain: c.plain_tokens_per_s.is_none(),
        }));
        self.answering = Some(Answering {
            conversation,
            stop,
            text: String::new(),
            stats: AnswerStats::default(),
        });
        self.failure = None;
    }

    /// Stops the answer being generated (it keeps what was generated so far).
    pub fn stop(&mut self) {
        if let Some(a) = &self.answering {
            a.stop.store(true, Ordering::Relaxed);
        }
    }

    /// Answers the last question again, in place of its answer.
    pub fn regenerate(&mut self) {
        let Some(i) = self.current else { return };
        if self.answering.is_some() || !self.is_ready() {
            return;
        }
        let id = self.conversations[i].id.clone();
        self.update_conversation(&id, |c| {
            if c.messages.last().map(|m| m.role) == Some(Role::Assistant) {
                c.messages.pop();
            }
        });
        self.ask();
    }

    fn retry(&mut self) {
        match self.failure.take().map(|f| f.retry) {
            Some(Retry::Setup) => self.configure(),
            Some(Retry::Answer) if self.is_ready() => self.ask(),
            Some(Retry::Answer) => self.configure(),
            None => {}
        }
    }

    fn new_conversation(&mut self) {
        self.current = None;
        self.failure = None;
        self.focus_input = true;
    }

    fn delete_conversation(&mut self, index: usize) {
        let c = self.conversations.remove(index);
        if let Err(e) = self.store.delete(&c.id) {
            self.notices
                .push(format!("{:?} could not be deleted: {e}", c.title));
        }
        self.current = match self.current {
            Some(i) if i == index => None,
            Some(i) if i > index => Some(i - 1),
            other => other,
        };
    }

    /// One frame.
    pub fn ui(&mut self, ui: &mut egui::Ui) {
        self.repaint.get_or_init(|| ui.ctx().clone());
        self.take_events();
        egui::Panel::top("status").show(ui, |ui| self.status_line(ui));
        egui::Panel::left("conversations")
            .default_size(210.0)
            .show(ui, |ui| self.conversation_list(ui));
        egui::Panel::right("speculation")
            .default_size(250.0)
            .show(ui, |ui| self.speculation_panel(ui));
        egui::Panel::bottom("composer").show(ui, |ui| self.composer(ui));
        egui::CentralPanel::default().show(ui, |ui| self.transcript(ui));
        self.settings_window(ui.ctx());
    }

    fn status_line(&mut self, ui: &mut egui::Ui) {
        ui.horizontal(|ui| {
            if ui.button("Settings").clicked() && self.form.is_none() {
                self.form = Some(SettingsForm::from(&self.settings, self.keys.load()));
            }
            match &self.status {
                Status::SettingUp { line, fraction } => {
                    ui.spinner();
                    if let Some(f) = fraction {
                        ui.add(egui::ProgressBar::new(*f).desired_width(120.0));
                    }
                    ui.label(line);
                }
                Status::Ready(line) => {
                    status_dot(ui, Color32::from_rgb(60, 170, 80));
                    ui.label(line);
                }
                Status::Failed(e) => {
                    status_dot(ui, RED);
                    ui.label(&e.headline);
                }
            }
        });
    }

    fn conversation_list(&mut self, ui: &mut egui::Ui) {
        ui.add_space(4.0);
        if ui.button("New conversation").clicked() {
            self.new_conversation();
        }
        ui.separator();
        let mut open = None;
        let mut delete = None;
        egui::ScrollArea::vertical().show(ui, |ui| {
            for (i, c) in self.conversations.iter().enumerate() {
                ui.horizontal(|ui| {
                    if ui
                        .small_button("×")
                        .on_hover_text("Delete this conversation")
                        .clicked()
                    {
                        delete = Some(i);
                    }
                    if ui
                        .selectable_label(self.current == Some(i), &c.title)
                        .clicked()
                    {
                        open = Some(i);
                    }
                });
            }
        });
        if let Some(i) = open {
            self.current = Some(i);
            self.failure = None;
        }
        if let Some(i) = delete.filter(|_| self.answering.is_none()) {
            self.delete_conversation(i);
        }
    }

    /// The latest answer's figures: the one being generated, else the conversation's last.
    fn shown_stats(&self) -> Option<(&AnswerStats, bool)> {
        if let Some(a) = &self.answering {
            return Some((&a.stats, true));
        }
        self.current()?
            .messages
            .iter()
            .rev()
            .find_map(|m| m.stats.as_ref())
            .map(|s| (s, false))
    }

    fn speculation_panel(&mut self, ui: &mut egui::Ui) {
        ui.heading("Speculation");
        let Some((s, live)) = self.shown_stats() else {
            ui.label("Figures appear with the first answer.");
            return;
        };
        let plain = self.current().and_then(|c| c.plain_tokens_per_s);
        egui::Grid::new("figures").num_columns(2).show(ui, |ui| {
            let mut row = |name: &str, value: String| {
                ui.label(name);
                ui.label(value);
                ui.end_row();
            };
            row("tokens/s", format!("{:.1}", s.tokens_per_s()));
            row("tokens per round", format!("{:.2}", s.tokens_per_pass()));
            row("round trip", format!("{:.0} ms", s.round_ms()));
            if !live {
                let (up, down) = s.bytes_per_round();
                row("bytes up/round", format!("{up:.0}"));
                row("bytes down/round", format!("{down:.0}"));
                row(
                    "verifier forward",
                    format!(
                        "{:.1} ms/round",
                        s.verifier_forward_s * 1e3 / s.rounds.max(1) as f64
                    ),
                );
            }
            row(
                "speed-up",
                match (s.speed_up(plain), plain) {
                    (Some(x), _) => format!("{x:.2}x over plain decoding"),
                    (None, None) => "measuring plain decoding…".into(),
                    (None, Some(_)) => "—".into(),
                },
            );
            row("tokens", format!("{} in {} rounds", s.tokens, s.rounds));
        });
        ui.add_space(8.0);
        ui.label("Acceptance by tree depth");
        acceptance_chart(ui, &s.acceptance_by_depth());
        if live {
            ui.label(RichText::new("live").small().weak());
        }
    }

    fn composer(&mut self, ui: &mut egui::Ui) {
        ui.add_space(4.0);
        let id = egui::Id::unique(INPUT_ID);
        let focused = ui.ctx().memory(|m| m.has_focus(id));
        // Enter sends; Shift+Enter reaches the text box and breaks the line.
        let enter =
            focused && ui.input_mut(|i| i.consume_key(egui::Modifiers::NONE, egui::Key::Enter));
        ui.horizontal(|ui| {
            let edit = egui::TextEdit::multiline(&mut self.input)
                .id(id)
                .hint_text("Ask anything (Enter sends, Shift+Enter breaks the line)")
                .desired_rows(2)
                .desired_width(ui.available_width() - 110.0);
            let response = ui.add(edit);
            if self.focus_input {
                response.request_focus();
                self.focus_input = false;
            }
            ui.vertical(|ui| {
                if self.answering.is_some() {
                    if ui.button("Stop").clicked() {
                        self.stop();
                    }
                } else {
                    let can_send = self.is_ready() && !self.input.trim().is_empty();
                    if ui
                        .add_enabled(can_send, egui::Button::new("Send"))
                        .clicked()
                    {
                        self.send();
                    }
                    let can_regenerate =
                        self.is_ready() && self.current().is_some_and(|c| !c.messages.is_empty());
                    if ui
                        .add_enabled(can_regenerate, egui::Button::new("Regenerate"))
                        .clicked()
                    {
                        self.regenerate();
                    }
                }
            });
        });
        if enter {
            self.send();
        }
        ui.add_space(4.0);
    }

    fn transcript(&mut self, ui: &mut egui::Ui) {
        let mut copy = None;
        let mut retry = false;
        let mut dismiss_notices = false;
        egui::ScrollArea::vertical()
            .stick_to_bottom(true)
            .auto_shrink([false, false])
            .show(ui, |ui| {
                if !self.notices.is_empty() {
                    egui::Frame::group(ui.style()).show(ui, |ui| {
                        for n in &self.notices {
                            ui.label(RichText::new(n).weak());
                        }
                        dismiss_notices = ui.small_button("Dismiss").clicked();
                    });
                }
                let answering_here = self
                    .answering
                    .as_ref()
                    .filter(|a| Some(&a.conversation) == self.current().map(|c| &c.id));
                if let Some(i) = self.current {
                    for m in &self.conversations[i].messages {
                        match m.role {
                            Role::User => {
                                egui::Frame::group(ui.style())
                                    .fill(ui.visuals().faint_bg_color)
                                    .show(ui, |ui| {
                                        ui.label(RichText::new("You").strong());
                                        ui.label(&m.content);
                                    });
                            }
                            Role::Assistant => {
                                ui.label(RichText::new("Assistant").strong());
                                CommonMarkViewer::new().show(ui, &mut self.markdown, &m.content);
                                ui.horizontal(|ui| {
                                    if ui.small_button("Copy").clicked() {
                                        copy = Some(m.content.clone());
                                    }
                                    if m.stopped {
                                        ui.label(RichText::new("(stopped)").weak());
                                    }
                                });
                            }
                        }
                        ui.add_space(6.0);
                    }
                } else if answering_here.is_none() {
                    ui.label(RichText::new("Ask anything below.").weak());
                }
                if let Some(a) = answering_here {
                    ui.label(RichText::new("Assistant").strong());
                    CommonMarkViewer::new().show(ui, &mut self.markdown, &a.text);
                    ui.spinner();
                }
                if let Some(f) = &self.failure {
                    egui::Frame::group(ui.style()).show(ui, |ui| {
                        ui.label(RichText::new(&f.error.headline).color(RED).strong());
                        ui.label(RichText::new(&f.error.detail).small());
                        retry = ui.button("Retry").clicked();
                    });
                }
            });
        if let Some(text) = copy {
            ui.ctx().copy_text(text);
        }
        if dismiss_notices {
            self.notices.clear();
        }
        if retry {
            self.retry();
        }
    }

    fn settings_window(&mut self, ctx: &egui::Context) {
        let Some(form) = self.form.as_mut() else {
            return;
        };
        let mut open = true;
        let mut apply = false;
        let mut cancel = false;
        egui::Window::new("Settings")
            .open(&mut open)
            .collapsible(false)
            .show(ctx, |ui| {
                form.ui(ui);
                ui.separator();
                ui.horizontal(|ui| {
                    apply = ui.button("Apply").clicked();
                    cancel = ui.button("Cancel").clicked();
                });
            });
        if apply {
            match form.settings() {
                Ok(settings) => {
                    let key = form.api_key.clone();
                    match self.apply_settings(settings, &key) {
                        Ok(()) => self.form = None,
                        Err(e) => {
                            if let Some(f) = self.form.as_mut() {
                                f.error = Some(e)
                            }
                        }
                    }
                }
                Err(e) => form.error = Some(e),
            }
        } else if cancel || !open {
            self.form = None;
        }
    }
}

const RED: Color32 = Color32::from_rgb(200, 60, 60);

/// A coloured dot: the setup's state at a glance.
fn status_dot(ui: &mut egui::Ui, colour: Color32) {
    let (rect, _) = ui.allocate_exact_size(egui::vec2(12.0, 12.0), egui::Sense::hover());
    ui.painter().circle_filled(rect.center(), 5.0, colour);
}

/// One bar per tree depth: the share of rounds that accepted a token that deep.
fn acceptance_chart(ui: &mut egui::Ui, shares: &[f64]) {
    if shares.is_empty() {
        ui.label(RichText::new("no drafted token accepted yet").weak());
        return;
    }
    let height = 90.0;
    let bar = 22.0;
    let (rect, _) = ui.allocate_exact_size(
        egui::vec2(shares.len() as f32 * (bar + 6.0), height + 16.0),
        egui::Sense::hover(),
    );
    let painter = ui.painter_at(rect);
    let colour = ui.visuals().selection.bg_fill;
    let text = ui.visuals().text_color();
    for (d, share) in shares.iter().enumerate() {
        let x = rect.left() + d as f32 * (bar + 6.0);
        let top = rect.top() + height * (1.0 - *share as f32);
        painter.rect_filled(
            egui::Rect::from_min_max(egui::pos2(x, top), egui::pos2(x + bar, rect.top() + height)),
            2.0,
            colour,
        );
        painter.text(
            egui::pos2(x + bar / 2.0, rect.top() + height + 2.0),
            egui::Align2::CENTER_TOP,
            format!("{}", d + 1),
            egui::FontId::proportional(11.0),
            text,
        );
    }
    let summary = shares
        .iter()
        .enumerate()
        .map(|(d, s)| format!("depth {}: {:.0}%", d + 1, s * 100.0))
        .collect::<Vec<_>>()
        .join(", ");
    ui.label(RichText::new(summary).small());
}

impl SettingsForm {
    fn from(settings: &Settings, api_key: Option<String>) -> SettingsForm {
        let (servers, server_name, pin, ca, use_ca) = match &settings.verifier {
            VerifierSetting::Embedded => (
                String::new(),
                "localhost".to_string(),
                String::new(),
                String::new(),
                false,
            ),
            VerifierSetting::Remote {
                servers,
                server_name,
                trust,
            } => match trust {
                TrustSetting::Pin(p) => (
                    servers.clone(),
                    server_name.clone(),
                    p.clone(),
                    String::new(),
                    false,
                ),
                TrustSetting::Ca(c) => (
                    servers.clone(),
                    server_name.clone(),
                    String::new(),
                    c.display().to_string(),
                    true,
                ),
            },
        };
        SettingsForm {
            remote: !matches!(settings.verifier, VerifierSetting::Embedded),
            settings: settings.clone(),
            api_key: api_key.unwrap_or_default(),
            servers,
            server_name,
            pin,
            ca,
            use_ca,
            seed: settings.seed.map(|s| s.to_string()).unwrap_or_default(),
            error: None,
        }
    }

    /// The settings as filled in.
    fn settings(&self) -> Result<Settings, String> {
        let mut s = self.settings.clone();
        s.verifier = VerifierSetting::Embedded;
        if self.remote {
            s.verifier = VerifierSetting::Remote {
                servers: self.servers.trim().to_string(),
                server_name: self.server_name.trim().to_string(),
                trust: if self.use_ca {
                    TrustSetting::Ca(PathBuf::from(self.ca.trim()))
                } else {
                    TrustSetting::Pin(self.pin.trim().to_string())
                },
            };
        }
        s.seed = match self.seed.trim() {
            "" => None,
            t => Some(
                t.parse()
                    .map_err(|_| format!("the seed {t:?} is not a whole number"))?,
            ),
        };
        Ok(s)
    }

    fn ui(&mut self, ui: &mut egui::Ui) {
        ui.heading("Verifier");
        ui.horizontal(|ui| {
            ui.radio_value(&mut self.remote, false, "Embedded (this computer)");
            ui.radio_value(&mut self.remote, true, "Remote");
        });
        if self.remote {
            egui::Grid::new("remote").num_columns(2).show(ui, |ui| {
                ui.label("Address");
                ui.add(
                    egui::TextEdit::singleline(&mut self.servers)
                        .hint_text("host:4433, or several comma-separated"),
                );
                ui.end_row();
                ui.label("Certificate name");
                ui.text_edit_singleline(&mut self.server_name);
                ui.end_row();
                ui.label("Check by");
                ui.horizontal(|ui| {
                    ui.radio_value(&mut self.use_ca, false, "pinned fingerprint");
                    ui.radio_value(&mut self.use_ca, true, "CA file");
                });
                ui.end_row();
                if self.use_ca {
                    ui.label("CA file (PEM)");
                    ui.text_edit_singleline(&mut self.ca);
                } else {
                    ui.label("Pin (SHA-256)");
                    ui.text_edit_singleline(&mut self.pin);
                }
                ui.end_row();
                ui.label("API key");
                ui.add(egui::TextEdit::singleline(&mut self.api_key).password(true));
                ui.end_row();
            });
        }
        ui.separator();
        ui.heading("Model");
        egui::Grid::new("model").num_columns(2).show(ui, |ui| {
            ui.label("LLM");
            let before = self.settings.llm.clone();
            ui.vertical(|ui| {
                for m in specinfer_edge::CATALOGUE {
                    ui.radio_value(&mut self.settings.llm, m.name.to_string(), m.name)
                        .on_hover_text(m.about);
                }
                let own_file = !specinfer_edge::CATALOGUE
                    .iter()
                    .any(|m| m.name == self.settings.llm);
                if ui.radio(own_file, "a GGUF file").clicked() && !own_file {
                    self.settings.llm.clear();
                }
                if own_file {
                    ui.add(
                        egui::TextEdit::singleline(&mut self.settings.llm)
                            .hint_text("/path/to/model.gguf"),
                    );
                }
            });
            // A draft model chosen for one LLM rarely speaks another's tokens: another LLM
            // starts with its own drafter.
            if self.settings.llm != before {
                self.settings.draft.clear();
            }
            ui.end_row();
        });
        ui.label(
            RichText::new("A catalogue model is downloaded from PyPI the first time (progress below the chat).")
                .weak(),
        );
        ui.separator();
        ui.heading("Drafting");
        egui::Grid::new("drafting").num_columns(2).show(ui, |ui| {
            ui.label("Draft model");
            ui.add(egui::TextEdit::singleline(&mut self.settings.draft).hint_text("the LLM's own"));
            ui.end_row();
            ui.label("Runs on");
            ui.horizontal(|ui| {
                ui.radio_value(&mut self.settings.backend, Backend::Candle, "candle");
                ui.radio_value(&mut self.settings.backend, Backend::Onnx, "ONNX Runtime");
            });
            ui.end_row();
            ui.label("Tree");
            ui.text_edit_singleline(&mut self.settings.tree)
                .on_hover_text(
                    "auto, none, or a shape such as dynamic:32 or 4,2,1 (see specinfer --help)",
                );
            ui.end_row();
        });
        ui.separator();
        ui.heading("Decoding");
        ui.horizontal(|ui| {
            ui.radio_value(&mut self.settings.greedy, false, "Sampling");
            ui.radio_value(&mut self.settings.greedy, true, "Greedy");
        });
        if !self.settings.greedy {
            egui::Grid::new("sampling").num_columns(2).show(ui, |ui| {
                ui.label("Temperature");
                ui.add(egui::Slider::new(
                    &mut self.settings.temperature,
                    0.05..=2.0,
                ));
                ui.end_row();
                ui.label("Top-p");
                ui.add(egui::Slider::new(&mut self.settings.top_p, 0.05..=1.0));
                ui.end_row();
                ui.label("Seed");
                ui.add(egui::TextEdit::singleline(&mut self.seed).hint_text("fresh each answer"));
                ui.end_row();
            });
        }
        ui.horizontal(|ui| {
            ui.label("Longest answer");
            ui.add(egui::DragValue::new(&mut self.settings.max_tokens).range(1..=4096));
            ui.label("tokens");
        });
        if let Some(e) = &self.error {
            ui.label(RichText::new(e).color(RED));
        }
    }
}
