//! Where a client may find verifiers: a list of `HOST:PORT`s, each a literal address or a name
//! that may resolve to several (a Kubernetes headless Service resolves to every ready pod).
//! Names are resolved again each time the client places a session, so a fleet that scales or
//! restarts is followed without restarting the client.

use std::net::SocketAddr;

/// The verifiers a client may use, as the user gave them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifierAddrs {
    entries: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddrsError {
    #[error("no verifier address given")]
    Empty,
    #[error("{0:?} is not HOST:PORT")]
    NotHostPort(String),
    #[error("resolving {0}: {1}")]
    Resolve(String, String),
    #[error("{0} resolves to no address")]
    NoAddress(String),
}

impl VerifierAddrs {
    /// `a:4433,b:4433` (comma-separated, spaces ignored); each entry `HOST:PORT`, HOST a name,
    /// an IPv4 address or a bracketed IPv6 one.
    pub fn parse(s: &str) -> Result<Self, AddrsError> {
        let entries: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect();
        if entries.is_empty() {
            return Err(AddrsError::Empty);
        }
        for e in &entries {
            let port_ok = e
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok {
                return Err(AddrsError::NotHostPort(e.clone()));
            }
        }
        Ok(VerifierAddrs { entries })
    }

    /// One known address.
    pub fn one(addr: SocketAddr) -> Self {
        VerifierAddrs {
            entries: vec![addr.to_string()],
        }
    }

    /// Every address the entries resolve to now, without repeats, in the order given. An entry
    /// that does not resolve is skipped when others do (a name of a fleet scaled to zero, a
    /// typo among good addresses); the error is returned when none resolves.
    pub async fn resolve(&self) -> Result<Vec<SocketAddr>, AddrsError> {
        let mut lookups = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let found = tokio::net::lookup_host(e.as_str()).await;
            lookups.push((e, found.map(|a| a.collect())));
        }
        gather(lookups)
    }

    /// [`VerifierAddrs::resolve`] outside an async runtime (a front end's setup, which reports
    /// a bad name before anything else).
    pub fn resolve_blocking(&self) -> Result<Vec<SocketAddr>, AddrsError> {
        use std::net::ToSocketAddrs;
        gather(
            self.entries
                .iter()
                .map(|e| (e, e.to_socket_addrs().map(|a| a.collect()))),
        )
    }
}

/// Every address of every entry's lookup, without repeats, in order; the first failure when
/// none gave an address.
fn gather<'e>(
    lookups: impl IntoIterator<Item = (&'e String, std::io::Result<Vec<SocketAddr>>)>,
) -> Result<Vec<SocketAddr>, AddrsError> {
    let mut out = Vec::new();
    let mut first_error = None;
    for (entry, found) in lookups {
        match found {
            Ok(addrs) => {
                let before = out.len();
                for a in addrs {
                    if !out.contains(&a) {
                        out.push(a);
                    }
                }
                if out.len() == before {
                    first_error.get_or_insert(AddrsError::NoAddress(entry.clone()));
                }
            }
            Err(err) => {
                first_error.get_or_insert(AddrsError::Resolve(entry.clone(), err.to_string()));
            }
        }
    }
    match (out.is_empty(), first_error) {
        (true, Some(e)) => Err(e),
        _ => Ok(out),
    }
}

impl std::fmt::Display for VerifierAddrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.entries.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lists_and_names_resolve_to_every_address_once() {
        let a = VerifierAddrs::parse("127.0.0.1:4433, 127.0.0.2:4433,127.0.0.1:4433").unwrap();
        assert_eq!(
            a.resolve().await.unwrap(),
            vec![
                "127.0.0.1:4433".parse::<SocketAddr>().unwrap(),
                "127.0.0.2:4433".parse().unwrap()
            ]
        );
        assert_eq!(a.resolve_blocking().unwrap(), a.resolve().await.unwrap());
        let v6 = VerifierAddrs::parse("[::1]:9")
            .unwrap()
            .resolve()
            .await
            .unwrap();
        assert_eq!(v6, vec!["[::1]:9".parse::<SocketAddr>().unwrap()]);
        let named = VerifierAddrs::parse("localhost:4433").unwrap();
        assert!(!named.resolve().await.unwrap().is_empty());
        // A bad entry among good ones is skipped; alone it is the error.
        let mixed = VerifierAddrs::parse("no-such-host.invalid:1,127.0.0.1:2").unwrap();
        assert_eq!(mixed.resolve().await.unwrap().len(), 1);
        assert!(VerifierAddrs::parse("no-such-host.invalid:1")
            .unwrap()
            .resolve()
            .await
            .is_err());
    }

    #[test]
    fn malformed_lists_are_refused_with_the_entry() {
        assert_eq!(VerifierAddrs::parse(" , "), Err(AddrsError::Empty));
        assert_eq!(
            VerifierAddrs::parse("a:1,b"),
            Err(AddrsError::NotHostPort("b".into()))
        );
        assert_eq!(
            VerifierAddrs::parse(":80"),
            Err(AddrsError::NotHostPort(":80".into()))
        );
        assert_eq!(
            VerifierAddrs::parse("a:99999"),
            Err(AddrsError::NotHostPort("a:99999".into()))
        );
    }
}
