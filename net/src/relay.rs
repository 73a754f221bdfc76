//! A UDP relay between QUIC clients and a verifier that adds what a wide-area path adds: a
//! one-way delay each way, jitter and loss, in user space (this project's CI kernels have no
//! `netem`). The benchmarks put every round-trip figure through it, so the delay is outside the
//! processes measured; the fault tests use it to cut a client's network.
//!
//! Each client address gets its own upstream socket (its own flow, as NAT would give it). Each
//! direction of a flow is a delay line: a datagram is stamped when it arrives and sent when its
//! delay (plus a uniform jitter) has passed, never before the one ahead of it, so jitter delays
//! but does not reorder. A line holds at most [`RelayConfig::queue_datagrams`]; past that,
//! datagrams are dropped, as a router's full queue drops them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the path adds to each datagram.
#[derive(Clone, Copy, Debug)]
pub struct RelayConfig {
    /// Added to every datagram in each direction (a round trip gets twice this).
    pub one_way_delay: Duration,
    /// A further delay drawn uniformly from [0, jitter] per datagram.
    pub jitter: Duration,
    /// The chance that a datagram is dropped, each way.
    pub loss: f64,
    /// Datagrams one direction of one flow may hold in flight before it drops.
    pub queue_datagrams: usize,
    /// Seeds the jitter and loss draws, so a run's path is reproducible.
    pub seed: u64,
}

impl RelayConfig {
    /// A path with round-trip time `rtt` split evenly over the two directions, no jitter or
    /// loss.
    pub fn round_trip(rtt: Duration) -> Self {
        RelayConfig {
            one_way_delay: rtt / 2,
            ..Self::default()
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            one_way_delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            queue_datagrams: 4096,
            seed: 0x5eed,
        }
    }
}

/// A running relay (see the module doc); stops when dropped.
pub struct UdpRelay {
    /// Where clients send to reach the server through the path.
    pub addr: SocketAddr,
    flows: Arc<Mutex<Vec<Arc<Flow>>>>,
    task: tokio::task::JoinHandle<()>,
}

struct Flow {
    client: SocketAddr,
    upstream: UdpSocket,
    /// Cut: every datagram of the flow is dropped from now on.
    dead: AtomicBool,
}

/// The jitter and loss draws: splitmix64 over a counter, shared by every line of a relay.
struct Draws {
    state: AtomicU64,
}

impl Draws {
    /// A uniform draw in [0, 1).
    fn uniform(&self) -> f64 {
        let mut z = self
            .state
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One direction of a flow: stamps datagrams on arrival, a task sends each when it is due.
#[derive(Clone)]
struct DelayLine {
    tx: mpsc::Sender<(Instant, Vec<u8>)>,
    cfg: RelayConfig,
    draws: Arc<Draws>,
}

impl DelayLine {
    /// A line whose due datagrams `deliver` sends.
    fn start<F, Fut>(cfg: RelayConfig, draws: Arc<Draws>, deliver: F) -> Self
    where
        F: Fn(Vec<u8>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(cfg.queue_datagrams.max(1));
        tokio::spawn(async move {
            while let Some((due, datagram)) = rx.recv().await {
                // The timer's granularity (1 ms) would delay a datagram that is already due.
                if due > Instant::now() {
                    tokio::time::sleep_until(due).await;
                }
                deliver(datagram).await;
            }
        });
        DelayLine { tx, cfg, draws }
    }

    /// Takes a datagram that arrived now; drops it on loss or a full line.
    fn push(&self, datagram: &[u8]) {
        if self.cfg.loss > 0.0 && self.draws.uniform() < self.cfg.loss {
            return;
        }
        let jitter = self.cfg.jitter.mul_f64(self.draws.uniform());
        let due = Instant::now() + self.cfg.one_way_delay + jitter;
        let _ = self.tx.try_send((due, datagram.to_vec()));
    }
}

impl UdpRelay {
    /// A relay to `server` that adds nothing but its own forwarding (must run inside a tokio
    /// runtime).
    pub async fn start(server: SocketAddr) -> std::io::Result<UdpRelay> {
        Self::with_path(server, RelayConfig::default()).await
    }

    /// A relay to `server` through a path as `cfg` describes (inside a tokio runtime).
    pub async fn with_path(server: SocketAddr, cfg: RelayConfig) -> std::io::Result<UdpRelay> {
        let bind: SocketAddr = if server.is_ipv4() {
            "127.0.0.1:0"
        } else {
            "[::1]:0"
        }
        .parse()
        .expect("literal address");
        let front = Arc::new(UdpSocket::bind(bind).await?);
        let addr = front.local_addr()?;
        let flows: Arc<Mutex<Vec<Arc<Flow>>>> = Default::default();
        let draws = Arc::new(Draws {
            state: AtomicU64::new(cfg.seed),
        });
        let task_flows = flows.clone();
        let task = tokio::spawn(async move {
            let mut lines: Vec<(SocketAddr, DelayLine)> = Vec::new();
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                let up = match lines.iter().find(|(c, _)| *c == from) {
                    Some((_, line)) => line.clone(),
                    None => {
                        let Ok(flow) = open_flow(server, from, bind).await else {
                            continue;
                        };
                        task_flows.lock().expect("relay lock").push(flow.clone());
                        let up = {
                            let flow = flow.clone();
                            DelayLine::start(cfg, draws.clone(), move |d| {
                                let flow = flow.clone();
                                async move {
                                    if !flow.dead.load(Ordering::Relaxed) {
                                        let _ = flow.upstream.send(&d).await;
                                    }
                                }
                            })
                        };
                        let down = {
                            let (flow, front) = (flow.clone(), front.clone());
                            DelayLine::start(cfg, draws.clone(), move |d| {
                                let (flow, front) = (flow.clone(), front.clone());
                                async move {
                                    if !flow.dead.load(Ordering::Relaxed) {
                                        let _ = front.send_to(&d, flow.client).await;
                                    }
                                }
                            })
                        };
                        tokio::spawn(async move {
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = flow.upstream.recv(&mut buf).await {
                                down.push(&buf[..n]);
                            }
                        });
                        lines.push((from, up.clone()));
                        up
                    }
                };
                up.push(&buf[..n]);
            }
        });
        Ok(UdpRelay { addr, flows, task })
    }

    /// Drops every datagram of the flows that exist now, from now on (a client's network
    /// dies); flows that start later go through.
    pub fn cut_existing(&self) {
        for f in self.flows.lock().expect("relay lock").iter() {
            f.dead.store(true, Ordering::Relaxed);
        }
    }
}

async fn open_flow(
    server: SocketAddr,
    client: SocketAddr,
    bind: SocketAddr,
) -> std::io::Result<Arc<Flow>> {
    let upstream = UdpSocket::bind(bind).await?;
    upstream.connect(server).await?;
    Ok(Arc::new(Flow {
        client,
        upstream,
        dead: false.into(),
    }))
}

/// Measures a path: `n` pings, one at a time, through a relay configured as `cfg` to a UDP
/// echo server on loopback; their round trips in ms (NaN for a ping lost on the way, given up
/// after 150 ms). What a report quotes as the relay's measured delay.
pub async fn probe_round_trips(cfg: RelayConfig, n: usize) -> std::io::Result<Vec<f64>> {
    let echo = UdpSocket::bind("127.0.0.1:0").await?;
    let server = echo.local_addr()?;
    let echo_task = tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = echo.recv_from(&mut buf).await {
            let _ = echo.send_to(&buf[..n], from).await;
        }
    });
    let relay = UdpRelay::with_path(server, cfg).await?;
    let client = UdpSocket::bind("127.0.0.1:0").await?;
    client.connect(relay.addr).await?;
    let mut out = Vec::new();
    let mut buf = [0u8; 64];
    for i in 0..n as u32 {
        let sent = std::time::Instant::now();
        client.send(&i.to_le_bytes()).await?;
        let reply = tokio::time::timeout(Duration::from_millis(150), async {
            // A late reply to a ping already given up on is skipped.
            loop {
                match client.recv(&mut buf).await {
                    Ok(4) if buf[..4] == i.to_le_bytes() => return true,
                    Ok(_) => continue,
                    Err(_) => return false,
                }
            }
        })
        .await;
        out.push(match reply {
            Ok(true) => sent.elapsed().as_secs_f64() * 1e3,
            _ => f64::NAN,
        });
    }
    echo_task.abort();
    Ok(out)
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn median(v: &[f64]) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// The relay's property: a ping's round trip through it is never below the two one-way
    /// delays it was told, and typically (the median) at most that plus a forwarding allowance
    /// (5 ms: two tokio timer ticks and two loopback hops each way on a two-core machine). A
    /// single ping may take longer when the machine is busy; that is the machine, not the relay.
    #[tokio::test(flavor = "current_thread")]
    async fn a_ping_through_the_relay_takes_the_round_trip_it_was_told() {
        for rtt_ms in [0u64, 14, 50] {
            let rtts =
                probe_round_trips(RelayConfig::round_trip(Duration::from_millis(rtt_ms)), 10)
                    .await
                    .unwrap();
            let told = rtt_ms as f64;
            assert!(rtts.iter().all(|&r| r >= told), "told {told} ms: {rtts:?}");
            assert!(median(&rtts) <= told + 5.0, "told {told} ms: {rtts:?}");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn jitter_stays_within_its_bound_and_loss_drops_about_its_share() {
        let cfg = RelayConfig {
            one_way_delay: Duration::from_millis(5),
            jitter: Duration::from_millis(4),
            ..RelayConfig::default()
        };
        let rtts = probe_round_trips(cfg, 20).await.unwrap();
        assert!(rtts.iter().all(|&r| r >= 10.0), "{rtts:?}");
        assert!(median(&rtts) <= 18.0 + 5.0, "{rtts:?}");
        assert!(
            rtts.iter().any(|&r| r > 11.0),
            "jitter added nothing: {rtts:?}"
        );
        let lossy = RelayConfig {
            loss: 0.3,
            ..RelayConfig::default()
        };
        let lost = probe_round_trips(lossy, 60)
            .await
            .unwrap()
            .iter()
            .filter(|r| r.is_nan())
            .count();
        // Each ping crosses twice: P(lost) = 1 - 0.7^2 = 0.51; 60 pings: 31 +- 8 (2 sd).
        assert!((15..=47).contains(&lost), "{lost} of 60 pings lost");
    }
}
