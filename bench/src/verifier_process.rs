//! The verifier as an operator runs it: the `specinfer-verifier` binary in its own process,
//! pinned to its own core, with its CPU time read from `/proc` and its counters from its admin endpoint's `/metrics`.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use specinfer_net::{RemoteConfig, Trust};
use specinfer_wire::ModelFingerprint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How to start a verifier process beyond the defaults of [`VerifierProcess::start`].
pub struct VerifierOptions<'a> {
    /// The core to pin it to.
    pub core: Option<usize>,
    pub llm: &'a Path,
    /// Its own draft model (server-side speculation).
    pub ssm: Option<&'a Path>,
    pub listen: SocketAddr,
    /// A certificate and key (PEM) shared with other verifiers; `None`: a fresh self-signed one.
    pub identity: Option<(&'a Path, &'a Path)>,
    /// More `serve` flags.
    pub extra: Vec<String>,
}

pub struct VerifierProcess {
    child: Child,
    /// The verifier's QUIC address.
    pub addr: SocketAddr,
    pin: String,
    metrics: SocketAddr,
    /// The kernel's clock ticks per second (`/proc` CPU times count them).
    ticks_per_second: f64,
}

impl VerifierProcess {
    /// Starts the verifier binary next to this one (`cargo build --release -p
    /// specinfer-verifier`) on `llm`, with `ssm` as its own draft model, pinned to `core` when
    /// given; waits until it listens.
    pub fn start(core: Option<usize>, llm: &Path, ssm: &Path) -> Result<Self> {
        Self::start_with(&VerifierOptions {
            core,
            llm,
            ssm: Some(ssm),
            listen: "127.0.0.1:0".parse().expect("literal"),
            identity: None,
            extra: Vec::new(),
        })
    }

    /// The verifier binary next to this one.
    pub fn exe() -> Result<std::path::PathBuf> {
        crate::common::sibling_exe("specinfer-verifier", "specinfer-verifier")
    }

    /// Starts the verifier binary as `opts` say; waits until it listens.
    pub fn start_with(opts: &VerifierOptions) -> Result<Self> {
        let exe = Self::exe()?;
        let metrics = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?
        };
        let mut cmd = match opts.core {
            Some(c) => {
                let mut t = Command::new("taskset");
                t.args(["-c", &c.to_string()]).arg(&exe);
                t
            }
            None => Command::new(&exe),
        };
        cmd.args([
            "serve",
            "--listen",
            &opts.listen.to_string(),
            "--insecure-no-auth",
        ]);
        match opts.identity {
            Some((cert, key)) => cmd.arg("--cert").arg(cert).arg("--key").arg(key),
            None => cmd.arg("--self-signed"),
        };
        if let Some(ssm) = opts.ssm {
            cmd.arg("--ssm").arg(ssm);
        }
        cmd.arg("--llm")
            .arg(opts.llm)
            .args(&opts.extra)
            .args(["--admin", &metrics.to_string()])
            .env("SPECINFER_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let stdout = child.stdout.take().context("the verifier's stdout")?;
        let mut pin = match opts.identity {
            Some((cert, key)) => {
                Some(specinfer_net::ServerIdentity::from_pem(cert, key)?.fingerprint())
            }
            None => None,
        };
        let mut addr = None;
        let mut lines = std::io::BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let line = line?;
            if let Some(p) = line.split("(pin it on clients): ").nth(1) {
                pin = Some(p.trim().to_string());
            }
            if let Some(a) = line
                .strip_prefix("listening on ")
                .and_then(|r| r.split_whitespace().next())
            {
                addr = Some(a.parse()?);
                break;
            }
        }
        // Keep reading what it prints later, or its next line would find the pipe closed.
        std::thread::spawn(move || lines.for_each(drop));
        let (Some(pin), Some(addr)) = (pin, addr) else {
            let _ = child.kill();
            bail!("the verifier exited before it listened");
        };
        Ok(VerifierProcess {
            child,
            addr,
            pin,
            metrics,
            ticks_per_second: clock_ticks_per_second(),
        })
    }

    /// A client's configuration for it, reaching it at `addr` (a relay in front of it).
    pub fn remote(&self, addr: SocketAddr, model: ModelFingerprint) -> Result<RemoteConfig> {
        Ok(RemoteConfig {
            addr,
            server_name: "localhost".into(),
            trust: Trust::pinned_hex(&self.pin)?,
            api_key: None,
            expected_model: model,
            idle_timeout: RemoteConfig::DEFAULT_IDLE_TIMEOUT,
        })
    }

    /// Its admin endpoint (metrics, probes, drain).
    pub fn admin(&self) -> SocketAddr {
        self.metrics
    }

    /// Waits until the process has exited (after a drain); false if it did not within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<bool> {
        let until = std::time::Instant::now() + limit;
        while std::time::Instant::now() < until {
            if self.child.try_wait()?.is_some() {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(false)
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// CPU seconds (user + system) the process has used so far.
    pub fn cpu_seconds(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces) start after its ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .context("a /proc stat line")?
            .1
            .split_whitespace()
            .collect();
        let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
        Ok(ticks / self.ticks_per_second)
    }

    /// Its resident memory (VmRSS).
    pub fn rss_bytes(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .context("no VmRSS in /proc/PID/status")?
            .trim()
            .parse()?;
        Ok(kib * 1024)
    }

    /// A counter from its Prometheus endpoint.
    pub async fn counter(&self, name: &str) -> Result<f64> {
        let mut sock = tokio::net::TcpStream::connect(self.metrics).await?;
        sock.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            .await?;
        let mut body = String::new();
        tokio::time::timeout(Duration::from_secs(5), sock.read_to_string(&mut body)).await??;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .with_context(|| format!("no counter {name} in the verifier's metrics"))
    }
}

impl Drop for VerifierProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Pins every thread of this process to `cores` (a taskset list such as "1" or "0-1").
pub fn pin_this_process(cores: &str) -> Result<()> {
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", cores, &std::process::id().to_string()])
        .stdout(Stdio::null())
        .status()
        .context("running taskset")?;
    if !status.success() {
        bail!("taskset -a -p -c {cores} failed");
    }
    Ok(())
}
