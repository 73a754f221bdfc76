//! SHA-256 digests as people write them (model checksums, certificate pins).

/// Parses a SHA-256 written as 64 hex digits (colons between bytes allowed).
pub fn parse_sha256_hex(hex: &str) -> Option<[u8; 32]> {
    let clean: String = hex.chars().filter(|c| *c != ':').collect();
    if clean.len() != 64 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..64)
        .step_by(2)
        .map(|i| u8::from_str_radix(clean.get(i..i + 2)?, 16).ok())
        .collect();
    bytes.and_then(|b| b.try_into().ok())
}
