//! TLS 1.3 for QUIC: the verifier's identity, and how a client trusts it.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::{NetError, ALPN};

/// SHA-256 of a certificate's DER, in hex: what clients pin.
pub fn cert_fingerprint(cert: &CertificateDer<'_>) -> String {
    Sha256::digest(cert.as_ref())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The server's certificate chain and key.
pub struct ServerIdentity {
    pub certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl ServerIdentity {
    /// A fresh self-signed certificate for `names` (clients pin its fingerprint).
    pub fn self_signed(names: &[&str]) -> Result<Self, NetError> {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .map_err(|e| NetError::Tls(e.to_string()))?;
        let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())
            .map_err(|e| NetError::Tls(e.to_string()))?;
        Ok(ServerIdentity {
            certs: vec![ck.cert.der().clone()],
            key,
        })
    }

    /// A fresh self-signed certificate for `names` and its key, in PEM: one identity a whole
    /// fleet can share (from files, or a Kubernetes Secret), so clients pin one fingerprint.
    pub fn self_signed_pem(names: &[&str]) -> Result<(String, String), NetError> {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .map_err(|e| NetError::Tls(e.to_string()))?;
        Ok((ck.cert.pem(), ck.signing_key.serialize_pem()))
    }

    /// A fresh self-signed ECDSA P-256 certificate valid for 13 days: what a browser accepts
    /// through WebTransport's `serverCertificateHashes` (at most 14 days) without any CA.
    pub fn self_signed_for_browsers(names: &[&str]) -> Result<Self, NetError> {
        let tls = |e: &dyn std::fmt::Display| NetError::Tls(e.to_string());
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .map_err(|e| tls(&e))?;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(13);
        let key =
            rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| tls(&e))?;
        let cert = params.self_signed(&key).map_err(|e| tls(&e))?;
        Ok(ServerIdentity {
            certs: vec![cert.der().clone()],
            key: PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| tls(&e))?,
        })
    }

    /// A certificate chain and private key from PEM files.
    pub fn from_pem(cert: &Path, key: &Path) -> Result<Self, NetError> {
        let file_err = |p: &Path, e: &dyn std::fmt::Display| NetError::File {
            path: p.display().to_string(),
            message: e.to_string(),
        };
        let certs = CertificateDer::pem_file_iter(cert)
            .map_err(|e| file_err(cert, &e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| file_err(cert, &e))?;
        if certs.is_empty() {
            return Err(file_err(cert, &"no certificate in the file"));
        }
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| file_err(key, &e))?;
        Ok(ServerIdentity { certs, key })
    }

    pub fn fingerprint(&self) -> String {
        cert_fingerprint(&self.certs[0])
    }

    pub fn quinn_config(&self) -> Result<quinn::ServerConfig, NetError> {
        self.quinn_config_with_alpn(ALPN)
    }

    /// The server config for another application protocol on the same identity (`h3` for
    /// WebTransport).
    pub fn quinn_config_with_alpn(&self, alpn: &[u8]) -> Result<quinn::ServerConfig, NetError> {
        let tls = |e: &dyn std::fmt::Display| NetError::Tls(e.to_string());
        let mut crypto = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls(&e))?
        .with_no_client_auth()
        .with_single_cert(self.certs.clone(), self.key.clone_key())
        .map_err(|e| tls(&e))?;
        crypto.alpn_protocols = vec![alpn.to_vec()];
        let quic =
            quinn::crypto::rustls::QuicServerConfig::try_from(crypto).map_err(|e| tls(&e))?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quic));
        let mut transport = quinn::TransportConfig::default();
        transport.max_concurrent_bidi_streams(256u32.into());
        // What a peer can make the verifier hold before the service reads anything (a client
        // that has not said hello included): 1 MiB unread per stream, 8 MiB per connection,
        // instead of quinn's 1.25 MB per stream and no connection bound.
        transport.stream_receive_window((1u32 << 20).into());
        transport.receive_window((8u32 << 20).into());
        if alpn == ALPN {
            // The native protocol uses neither unidirectional streams nor datagrams (HTTP/3,
            // under WebTransport, needs both).
            transport.max_concurrent_uni_streams(0u32.into());
            transport.datagram_receive_buffer_size(None);
        }
        transport.max_idle_timeout(Some(
            std::time::Duration::from_secs(60)
                .try_into()
                .expect("60 s fits"),
        ));
        cfg.transport_config(Arc::new(transport));
        Ok(cfg)
    }
}

/// How a client decides to trust the verifier's certificate.
#[derive(Clone, Debug)]
pub enum Trust {
    /// SHA-256 of the server's certificate (as printed by `serve --self-signed`).
    Pinned([u8; 32]),
    /// CA certificates (PEM) that must sign the server's certificate for its name.
    Roots(std::path::PathBuf),
}

impl Trust {
    /// Parses a pinned fingerprint given as 64 hex digits (colons allowed).
    pub fn pinned_hex(hex: &str) -> Result<Self, NetError> {
        specinfer_wire::parse_sha256_hex(hex)
            .map(Trust::Pinned)
            .ok_or_else(|| {
                NetError::Tls(format!(
                    "{hex:?} is not a SHA-256 fingerprint (64 hex digits)"
                ))
            })
    }
}

#[derive(Debug)]
struct PinnedCert {
    sha256: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if Sha256::digest(end_entity.as_ref()).as_slice() == self.sha256 {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the verifier's certificate fingerprint {} is not the pinned one",
                cert_fingerprint(end_entity)
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The QUIC client configuration for a trust policy.
pub fn client_config(trust: &Trust) -> Result<quinn::ClientConfig, NetError> {
    let tls = |e: &dyn std::fmt::Display| NetError::Tls(e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls(&e))?;
    let mut crypto = match trust {
        Trust::Pinned(sha256) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedCert {
                sha256: *sha256,
                provider,
            }))
            .with_no_client_auth(),
        Trust::Roots(path) => {
            let mut roots = rustls::RootCertStore::empty();
            let file_err = |e: &dyn std::fmt::Display| NetError::File {
                path: path.display().to_string(),
                message: e.to_string(),
            };
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| file_err(&e))? {
                roots
                    .add(cert.map_err(|e| file_err(&e))?)
                    .map_err(|e| file_err(&e))?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    crypto.alpn_protocols = vec![ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(crypto).map_err(|e| tls(&e))?;
    Ok(quinn::ClientConfig::new(Arc::new(quic)))
}
