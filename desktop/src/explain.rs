//! Errors said in words a user can act on: what went wrong, in a line, and the details below.

use specinfer_edge::{ClientError, SetupError};
use specinfer_net::{NetError, RemoteError};
use specinfer_wire::ErrorCode;

/// An error as the window shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct UiError {
    /// What happened, for anyone.
    pub headline: String,
    /// The error's own words (for a bug report or an operator).
    pub detail: String,
}

impl UiError {
    pub fn new(headline: impl Into<String>, detail: impl Into<String>) -> UiError {
        UiError {
            headline: headline.into(),
            detail: detail.into(),
        }
    }
}

/// The remote error inside `e`, if it is one.
fn remote(e: &SetupError) -> Option<&RemoteError> {
    match e {
        SetupError::Client(ClientError::Remote(r)) => Some(r),
        SetupError::Context { source, .. } => remote(source),
        _ => None,
    }
}

fn net(e: &SetupError) -> Option<&NetError> {
    match e {
        SetupError::Net(n) => Some(n),
        SetupError::Context { source, .. } => net(source),
        _ => remote(e).and_then(|r| match r {
            RemoteError::Net(n) => Some(n),
            _ => None,
        }),
    }
}

pub fn explain(e: &SetupError) -> UiError {
    let detail = e.to_string();
    let headline = if let Some(RemoteError::Refused(frame)) = remote(e) {
        match frame.code {
            ErrorCode::Busy => "The verifier is busy: try again in a moment.",
            ErrorCode::Unauthorized => {
                "The verifier refused the API key: check it in Settings."
            }
            ErrorCode::ModelMismatch => {
                "The verifier serves another model than this app drafts for."
            }
            ErrorCode::LimitExceeded => {
                "The conversation is too long for the model's context: start a new one, or ask for a shorter answer."
            }
            ErrorCode::Draining => "The verifier is restarting: try again in a moment.",
            ErrorCode::UnsupportedVersion => {
                "The verifier speaks another protocol version: update the app or the verifier."
            }
            _ => "The verifier refused the request.",
        }
    } else if detail.contains("pinned") || detail.contains("certificate") {
        "The verifier's certificate is not the one expected: check the pin or CA in Settings."
    } else if let Some(n) = net(e) {
        match n {
            NetError::Timeout | NetError::Connection(_) | NetError::Connect(_) => {
                "The verifier cannot be reached: check the address and your network."
            }
            NetError::File { .. } => "A file named in Settings cannot be read.",
            _ => "The connection to the verifier failed.",
        }
    } else if let Some(RemoteError::Protocol(_)) = remote(e) {
        "The verifier answered something this app does not understand."
    } else if matches!(e, SetupError::Invalid(_)) {
        "These settings cannot work:"
    } else if matches!(
        e,
        SetupError::Client(ClientError::Addrs(_)) | SetupError::Context { .. }
    ) && detail.contains("resolve")
    {
        "The verifier's name does not resolve: check the address."
    } else {
        "Something went wrong."
    };
    UiError::new(headline, detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use specinfer_wire::ErrorFrame;

    fn refused(code: ErrorCode) -> SetupError {
        SetupError::Client(ClientError::Remote(RemoteError::Refused(ErrorFrame {
            code,
            session: None,
            message: "no".into(),
            retry_after_ms: None,
        })))
    }

    #[test]
    fn refusals_and_network_failures_are_said_in_words() {
        assert!(explain(&refused(ErrorCode::Busy)).headline.contains("busy"));
        assert!(explain(&refused(ErrorCode::Unauthorized))
            .headline
            .contains("API key"));
        assert!(explain(&refused(ErrorCode::LimitExceeded))
            .headline
            .contains("context"));
        let timeout = SetupError::Client(ClientError::Remote(RemoteError::Net(NetError::Timeout)));
        assert!(explain(&timeout).headline.contains("cannot be reached"));
        let pin = SetupError::Net(NetError::Tls(
            "the verifier's certificate fingerprint ab is not the pinned one".into(),
        ));
        let e = explain(&pin);
        assert!(e.headline.contains("pin"), "{e:?}");
        assert!(e.detail.contains("not the pinned one"));
    }
}
