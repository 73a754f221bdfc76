//! `specinfer-desktop`: opens the chat window.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use specinfer_desktop::{AppConfig, DesktopApp};

#[derive(Parser)]
#[command(
    name = "specinfer-desktop",
    version,
    about = "specinfer's chat window: a small model on this computer drafts, the LLM verifies (embedded here by default, or on a remote verifier chosen in Settings). Conversations and settings are kept in the platform's data folder."
)]
struct Args {
    /// Keep conversations and settings here instead of the platform's data folder.
    #[arg(long, env = "SPECINFER_DESKTOP_DATA")]
    data_dir: Option<PathBuf>,
    /// Keep the API key in a file readable only by you, never in the system keyring.
    #[arg(long)]
    no_keyring: bool,
}

fn main() -> Result<()> {
    specinfer_edge::init_logging();
    let args = Args::parse();
    let mut config = match args.data_dir {
        Some(data_dir) => AppConfig {
            data_dir,
            keyring: true,
        },
        None => AppConfig::platform_default()
            .context("this system has no data folder for apps: give --data-dir")?,
    };
    config.keyring &= !args.no_keyring;
    let app = DesktopApp::new(config.clone())
        .with_context(|| format!("opening {}", config.data_dir.display()))?;
    let options = eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default()
            .with_title("specinfer")
            .with_inner_size([1100.0, 720.0])
            .with_min_inner_size([640.0, 400.0]),
        ..Default::default()
    };
    eframe::run_native(
        "specinfer",
        options,
        Box::new(|_| Ok(Box::new(Window(app)))),
    )
    // The usual cause on Linux is a machine without an OpenGL library (libGL or libEGL are
    // loaded at run time, so the binary starts without them): say which packages give one.
    .map_err(|e| {
        anyhow::anyhow!(
            "opening the window: {e}\n(the window draws with OpenGL 2 or later; on Linux that needs \
             Mesa's libraries, e.g. Debian's libgl1 libegl1 libgl1-mesa-dri)"
        )
    })
}

/// The app in eframe's window.
struct Window(DesktopApp);

impl eframe::App for Window {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        self.0.ui(ui);
    }
}
