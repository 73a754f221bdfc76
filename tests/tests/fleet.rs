//! The verifier fleet across real addresses: three `specinfer-verifier` processes, each in its
//! own network namespace joined to this one by a veth link, and 16 clients (8 greedy, 8 seeded
//! sampling) generating over and over while one verifier is killed, all three are drained and
//! restarted one after another, or one verifier's link is cut. Every answer must equal the
//! session's solo run on a healthy fleet, and no session may see an error.
//!
//! Network namespaces need root: without it each test says so and passes without running.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use specinfer_edge::{Client, Generation};
use specinfer_integration::{cache_dir, chat_ids, default_ssm, smollm2, verifier_exe, API_KEY};
use specinfer_model::fetch;
use specinfer_net::{RemoteConfig, ServerIdentity, Trust, VerifierAddrs};
use specinfer_speculator::{
    CachedDraft, DraftMode, DraftModel, Drafter, RoundDriver, Speculator, TreeShape,
};
use specinfer_wire::{SamplingParams, VerifyMode};

const CLIENTS: usize = 16;
const TOKENS: u32 = 40;
const PORT: u16 = 4433;
const ADMIN_PORT: u16 = 9464;
/// The clients' QUIC idle timeout: how soon they notice a dead or cut-off verifier.
const IDLE: Duration = Duration::from_secs(3);

/// The fleet tests take turns, across every process on this machine (two test runs at once
/// included): each starts three verifiers on a 2-core machine, in namespaces and on subnets
/// whose names are the same for every fleet. An advisory lock on one file; the kernel drops
/// it when the holder exits, however it exits.
fn take_turn() -> std::fs::File {
    let path = std::env::temp_dir().join("specinfer-fleet-tests.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    file.lock().unwrap();
    file
}

/// One client's request: greedy for even jobs, seeded sampling for odd ones.
#[derive(Clone)]
struct Job {
    prompt: Vec<u32>,
    params: SamplingParams,
}

fn jobs() -> Vec<Job> {
    const PROMPTS: [&str; CLIENTS] = [
        "What is the capital of France?",
        "Write a haiku about rain.",
        "Name three primary colors.",
        "How do plants make food?",
        "Give me a tip for learning to code.",
        "What is 12 times 12?",
        "Describe a cat in one sentence.",
        "Why is the sky blue?",
        "Suggest a name for a goldfish.",
        "What does a compiler do?",
        "Tell me a fun fact about the moon.",
        "How many legs does a spider have?",
        "What is the boiling point of water?",
        "Write a short greeting for a birthday card.",
        "What is the largest ocean?",
        "Explain what a network is.",
    ];
    let (_, tok) = smollm2();
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut params = SamplingParams {
                stop_ids: tok.eos().to_vec(),
                ..SamplingParams::greedy(TOKENS)
            };
            if i % 2 == 1 {
                params.mode = VerifyMode::Stochastic;
                params.temperature = 0.8;
                params.top_p = 0.95;
                params.seed = 1000 + i as u64;
            }
            Job {
                prompt: chat_ids(p),
                params,
            }
        })
        .collect()
}

/// The default SSM drafting a fixed dynamic tree (a fixed shape keeps seeded sampling
/// reproducible: the adaptive shapes follow measured timings).
fn driver(job: &Job) -> RoundDriver<'static> {
    let mode = match job.params.mode {
        VerifyMode::Greedy => DraftMode::Greedy,
        _ => DraftMode::sampled(job.params.temperature, job.params.top_p),
    };
    let drafter = Drafter {
        speculator: Speculator::for_request(
            TreeShape::Dynamic { budget: 16 },
            mode,
            job.params.seed,
        ),
        drafts: vec![Box::new(CachedDraft::new(default_ssm())) as Box<dyn DraftModel + Send>],
    };
    RoundDriver::new(job.prompt.clone(), job.params.clone(), Some(drafter)).unwrap()
}

/// Runs `cmd`, panicking with its output when it fails.
fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace joined to this one by a veth pair: the verifier listens on `addr`
/// inside it; cutting `host_if` cuts it off.
struct Namespace {
    name: String,
    host_if: String,
    ip: String,
}

impl Namespace {
    /// Namespace `i` of the fleet: fixed names and subnets, which [`take_turn`] keeps to one
    /// fleet at a time; what a killed run left behind is removed first.
    fn create(i: usize) -> Namespace {
        let name = format!("specinfer-fleet-{i}");
        let host_if = format!("sfleet{i}h");
        let peer_if = format!("sfleet{i}p");
        let subnet = format!("10.231.{i}");
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        sh(&["ip", "netns", "add", &name]);
        sh(&[
            "ip", "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
        ]);
        sh(&["ip", "link", "set", &peer_if, "netns", &name]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{subnet}.1/24"),
            "dev",
            &host_if,
        ]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["ip", "netns", "exec", &name];
            all.extend_from_slice(args);
            sh(&all);
        };
        inside(&[
            "ip",
            "addr",
            "add",
            &format!("{subnet}.2/24"),
            "dev",
            &peer_if,
        ]);
        inside(&["ip", "link", "set", &peer_if, "up"]);
        inside(&["ip", "link", "set", "lo", "up"]);
        Namespace {
            name,
            host_if,
            ip: format!("{subnet}.2"),
        }
    }

    fn link(&self, up: bool) {
        sh(&[
            "ip",
            "link",
            "set",
            &self.host_if,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Three verifier processes, one per namespace, sharing one certificate and key file.
struct Fleet {
    namespaces: Vec<Namespace>,
    verifiers: Vec<Option<Child>>,
    /// The certificate, key and API key files, private to this fleet.
    dir: tempfile::TempDir,
    llm: PathBuf,
    pin: String,
}

impl Fleet {
    /// `None` (after saying why) when this process may not create network namespaces.
    fn start() -> Option<Fleet> {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        if !root || Command::new("ip").arg("-V").output().is_err() {
            eprintln!(
                "SKIPPED: the fleet tests put each verifier in its own network namespace (ip netns), which needs root and iproute2"
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str| dir.path().join(name);
        let (cert, key) = ServerIdentity::self_signed_pem(&["verifier.test"]).unwrap();
        std::fs::write(file("cert.pem"), cert).unwrap();
        std::fs::write(file("key.pem"), key).unwrap();
        std::fs::write(file("keys.txt"), format!("{API_KEY}\n")).unwrap();
        let pin = ServerIdentity::from_pem(&file("cert.pem"), &file("key.pem"))
            .unwrap()
            .fingerprint();
        let llm = fetch::ensure(&fetch::SMOLLM2_135M, &cache_dir()).unwrap();
        let namespaces: Vec<Namespace> = (0..3).map(Namespace::create).collect();
        let mut fleet = Fleet {
            verifiers: (0..3).map(|_| None).collect(),
            namespaces,
            dir,
            llm,
            pin,
        };
        for i in 0..3 {
            fleet.spawn(i);
        }
        Some(fleet)
    }

    fn addr(&self, i: usize) -> SocketAddr {
        format!("{}:{PORT}", self.namespaces[i].ip).parse().unwrap()
    }

    fn admin(&self, i: usize) -> String {
        format!("{}:{ADMIN_PORT}", self.namespaces[i].ip)
    }

    /// Starts verifier `i` in its namespace and waits until it listens.
    fn spawn(&mut self, i: usize) {
        let file = |name: &str| self.dir.path().join(name).display().to_string();
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.namespaces[i].name])
            .arg(verifier_exe())
            .args(["serve", "--listen", &self.addr(i).to_string()])
            .args(["--cert", &file("cert.pem"), "--key", &file("key.pem")])
            .args(["--api-keys", &file("keys.txt")])
            .arg("--llm")
            .arg(&self.llm)
            .args(["--admin", &self.admin(i), "--drain-timeout-s", "30"])
            .env("SPECINFER_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let listening = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.starts_with("listening on"));
        assert!(listening, "verifier {i} exited before it listened");
        std::thread::spawn(move || lines.for_each(drop));
        self.verifiers[i] = Some(child);
    }

    fn kill(&mut self, i: usize) {
        let mut child = self.verifiers[i].take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A rolling restart's step: drain verifier `i`, by `specinfer-verifier drain` over its
    /// admin endpoint (as a Kubernetes preStop hook runs it) or by SIGTERM (as Kubernetes
    /// stops a container), wait until it has exited by itself, and start a new process on the
    /// same address.
    fn drain_and_restart(&mut self, i: usize, by_admin_call: bool) {
        let mut child = self.verifiers[i].take().expect("running");
        if by_admin_call {
            let out = Command::new(verifier_exe())
                .args(["drain", "--admin", &self.admin(i), "--timeout-s", "30"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "drain: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        } else {
            sh(&["kill", "-TERM", &child.id().to_string()]);
        }
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "verifier {i} exited with {status} after draining"
        );
        self.spawn(i);
    }

    fn client_config(&self) -> (RemoteConfig, VerifierAddrs) {
        let (_, tok) = smollm2();
        let cfg = RemoteConfig {
            addr: self.addr(0),
            server_name: "verifier.test".into(),
            trust: Trust::pinned_hex(&self.pin).unwrap(),
            api_key: Some(API_KEY.into()),
            expected_model: tok.fingerprint(),
            idle_timeout: IDLE,
        };
        let list = (0..3).map(|i| self.addr(i).to_string()).collect::<Vec<_>>();
        (cfg, VerifierAddrs::parse(&list.join(",")).unwrap())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for child in self.verifiers.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Each job's answer alone on a healthy fleet, one at a time (computed once per test binary).
fn solo_answers(fleet: &Fleet, rt: &tokio::runtime::Runtime) -> &'static Vec<Vec<u32>> {
    static SOLO: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    SOLO.get_or_init(|| {
        let (cfg, addrs) = fleet.client_config();
        rt.block_on(async {
            let mut client = Client::connect_fleet(cfg, addrs).await.unwrap();
            let mut answers = Vec::new();
            for job in jobs() {
                let g = client.generate(&mut driver(&job), |_| {}).await.unwrap();
                assert!(g.token_ids.len() > 4, "a real answer: {:?}", g.token_ids);
                answers.push(g.token_ids);
            }
            client.shutdown().await;
            answers
        })
    })
}

/// What the clients did while the fault was injected.
struct Outcome {
    answers: usize,
    recoveries: usize,
    /// The longest wait for a round, over all sessions.
    longest_stall: Duration,
}

/// 16 clients answer their jobs over and over until `fault` (run once every client has had
/// tokens back) returns and each has finished one more answer; every answer must equal its solo
/// run and no generation may fail.
fn under_fault(
    fleet: &mut Fleet,
    rt: &tokio::runtime::Runtime,
    fault: impl FnOnce(&mut Fleet, &[SocketAddr]),
) -> Outcome {
    let solo = solo_answers(fleet, rt);
    let (cfg, addrs) = fleet.client_config();
    let started = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let placed = Arc::new(Mutex::new(vec![None; CLIENTS]));
    let mut tasks = Vec::new();
    for (j, job) in jobs().into_iter().enumerate() {
        let (cfg, addrs, expected) = (cfg.clone(), addrs.clone(), solo[j].clone());
        let (started, stop, placed) = (started.clone(), stop.clone(), placed.clone());
        tasks.push(rt.spawn(async move {
            let mut client = Client::connect_fleet(cfg, addrs).await.unwrap();
            placed.lock().unwrap()[j] = Some(client.verifier());
            let (mut answers, mut recoveries, mut stall) = (0, 0, Duration::ZERO);
            let mut counted = false;
            loop {
                let stopping = stop.load(Ordering::SeqCst);
                let mut last = Instant::now();
                let g: Generation = client
                    .generate(&mut driver(&job), |_| {
                        stall = stall.max(last.elapsed());
                        last = Instant::now();
                        if !counted {
                            counted = true;
                            started.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                    .await
                    .unwrap_or_else(|e| panic!("job {j}: {e}"));
                assert_eq!(
                    g.token_ids, expected,
                    "job {j} ({:?}, served by {:?}) differs from its solo run",
                    job.params.mode, g.served_by
                );
                answers += 1;
                recoveries += g.reconnects;
                if stopping {
                    break;
                }
            }
            client.shutdown().await;
            (answers, recoveries, stall)
        }));
    }
    while started.load(Ordering::SeqCst) < CLIENTS {
        assert!(tasks.iter().all(|t| !t.is_finished()), "a client failed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let placed: Vec<SocketAddr> = placed.lock().unwrap().iter().flatten().copied().collect();
    fault(fleet, &placed);
    stop.store(true, Ordering::SeqCst);
    let mut outcome = Outcome {
        answers: 0,
        recoveries: 0,
        longest_stall: Duration::ZERO,
    };
    for t in tasks {
        let (a, r, s) = rt.block_on(t).expect("a client panicked");
        outcome.answers += a;
        outcome.recoveries += r;
        outcome.longest_stall = outcome.longest_stall.max(s);
    }
    eprintln!(
        "{} answers, {} recoveries, longest stall {:.2} s",
        outcome.answers,
        outcome.recoveries,
        outcome.longest_stall.as_secs_f64()
    );
    outcome
}

/// The verifier the most clients were placed on.
fn busiest(fleet: &Fleet, placed: &[SocketAddr]) -> usize {
    (0..3)
        .max_by_key(|&i| placed.iter().filter(|&&a| a == fleet.addr(i)).count())
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_verifier_killed_mid_answer_costs_no_answer_anything() {
    let _turn = take_turn();
    let Some(mut fleet) = Fleet::start() else {
        return;
    };
    let rt = runtime();
    let outcome = under_fault(&mut fleet, &rt, |fleet, placed| {
        let victim = busiest(fleet, placed);
        assert!(
            placed.iter().any(|&a| a != fleet.addr(victim)),
            "placement spread the clients over several verifiers: {placed:?}"
        );
        fleet.kill(victim);
    });
    assert!(
        outcome.recoveries > 0,
        "some session was on the killed verifier"
    );
}

#[test]
fn a_rolling_restart_moves_every_session_without_an_error() {
    let _turn = take_turn();
    let Some(mut fleet) = Fleet::start() else {
        return;
    };
    let rt = runtime();
    let outcome = under_fault(&mut fleet, &rt, |fleet, _| {
        for i in 0..3 {
            fleet.drain_and_restart(i, i == 0);
        }
    });
    assert!(
        outcome.recoveries > 0,
        "sessions moved off draining verifiers"
    );
}

#[test]
fn a_cut_link_is_noticed_within_the_idle_timeout_and_sessions_finish_elsewhere() {
    let _turn = take_turn();
    let Some(mut fleet) = Fleet::start() else {
        return;
    };
    let rt = runtime();
    let mut cut = None;
    let outcome = under_fault(&mut fleet, &rt, |fleet, placed| {
        let victim = busiest(fleet, placed);
        fleet.namespaces[victim].link(false);
        cut = Some(victim);
    });
    fleet.namespaces[cut.unwrap()].link(true);
    assert!(
        outcome.recoveries > 0,
        "some session was behind the cut link"
    );
    // Noticed by the idle timeout, a resume tried for at most half of it, then elsewhere; the
    // bound is loose for a loaded 2-core machine, but a client that hangs on the dead link
    // fails it.
    assert!(
        outcome.longest_stall < IDLE * 5,
        "longest wait for a round {:?}",
        outcome.longest_stall
    );
}
