//! API keys on the public APIs.
//!
//! A caller presents `Authorization: Bearer KEY` (an HTTP header, or the
//! gRPC metadata entry `authorization`). [`ApiKeys::check_bearer`] compares
//! the key with every configured key in constant time (no early exit on the
//! first differing byte, nor on the first matching key), so the time taken
//! says nothing about how close a guess was. An empty [`ApiKeys`] accepts
//! every caller: keys are off unless configured.

use std::path::Path;
use std::sync::Arc;

/// Why a caller was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    #[error("missing API key: send the header `authorization: Bearer <key>`")]
    Missing,
    #[error("malformed authorization header: expected `Bearer <key>`")]
    Malformed,
    #[error("invalid API key")]
    Invalid,
}

/// Errors reading an API keys file.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeysFileError {
    #[error("reading API keys from {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has no API keys (one per line; `#` starts a comment)")]
    Empty { path: String },
}

/// The keys a public API accepts (none: every caller is accepted).
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<Vec<u8>>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys")
            .field("count", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl ApiKeys {
    /// Accepts exactly these keys (blank ones are dropped).
    pub fn new<I, S>(keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let keys = keys
            .into_iter()
            .map(|k| k.as_ref().trim().as_bytes().to_vec())
            .filter(|k| !k.is_empty())
            .collect();
        Self {
            keys: Arc::new(keys),
        }
    }

    /// Reads keys from a file, one per line; blank lines and lines starting
    /// with `#` are skipped. A file with no key is an error (it would
    /// silently turn authentication off).
    pub fn from_file(path: &Path) -> Result<Self, ApiKeysFileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ApiKeysFileError::Read {
            path: name.clone(),
            source,
        })?;
        let keys = Self::new(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#')),
        );
        if keys.is_empty() {
            return Err(ApiKeysFileError::Empty { path: name });
        }
        Ok(keys)
    }

    /// These keys and `other`'s.
    pub fn merged(&self, other: &ApiKeys) -> ApiKeys {
        let mut keys = (*self.keys).clone();
        keys.extend(other.keys.iter().cloned());
        Self {
            keys: Arc::new(keys),
        }
    }

    /// No keys: every caller is accepted.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many keys are accepted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Checks an `Authorization` header value (`None`: the header is
    /// absent). Always `Ok` when no keys are configured.
    pub fn check_bearer(&self, header: Option<&[u8]>) -> Result<(), ApiKeyError> {
        if self.is_empty() {
            return Ok(());
        }
        let header = header.ok_or(ApiKeyError::Missing)?;
        let key = bearer_token(header).ok_or(ApiKeyError::Malformed)?;
        let mut matched = false;
        for k in self.keys.iter() {
            matched |= constant_time_eq(k, key);
        }
        if matched {
            Ok(())
        } else {
            Err(ApiKeyError::Invalid)
        }
    }

    /// The gRPC interceptor that checks the `authorization` metadata.
    pub fn interceptor(&self) -> ApiKeyInterceptor {
        ApiKeyInterceptor { keys: self.clone() }
    }
}

/// The token of `Bearer TOKEN` (the scheme is case-insensitive, as HTTP
/// says), or `None`.
fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if header.len() <= SCHEME.len() || !header[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = header[SCHEME.len()..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `a == b`, in time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

/// A tonic interceptor refusing calls without a valid key with
/// `UNAUTHENTICATED` (wrap a service with
/// `tonic::service::interceptor::InterceptedService::new(svc, keys.interceptor())`).
#[derive(Clone, Debug)]
pub struct ApiKeyInterceptor {
    keys: ApiKeys,
}

impl tonic::service::Interceptor for ApiKeyInterceptor {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        match self.keys.check_bearer(header) {
            Ok(()) => Ok(request),
            Err(e) => Err(tonic::Status::unauthenticated(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn no_keys_accepts_everyone() {
        assert_eq!(ApiKeys::default().check_bearer(None), Ok(()));
    }

    #[test]
    fn bearer_keys_are_checked() {
        let keys = ApiKeys::new(["alpha", "beta"]);
        assert_eq!(keys.check_bearer(Some(b"Bearer alpha")), Ok(()));
        assert_eq!(keys.check_bearer(Some(b"bearer beta")), Ok(()));
        assert_eq!(keys.check_bearer(None), Err(ApiKeyError::Missing));
        assert_eq!(
            keys.check_bearer(Some(b"Basic YWxwaGE=")),
            Err(ApiKeyError::Malformed)
        );
        assert_eq!(
            keys.check_bearer(Some(b"Bearer ")),
            Err(ApiKeyError::Malformed)
        );
        assert_eq!(
            keys.check_bearer(Some(b"Bearer alph")),
            Err(ApiKeyError::Invalid)
        );
        assert_eq!(
            keys.check_bearer(Some(b"Bearer alphaa")),
            Err(ApiKeyError::Invalid)
        );
    }

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn keys_file_skips_comments_and_refuses_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys");
        std::fs::write(&path, "# team keys\n\n  k1  \nk2\n").expect("write");
        let keys = ApiKeys::from_file(&path).expect("keys");
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.check_bearer(Some(b"Bearer k1")), Ok(()));
        std::fs::write(&path, "# nothing\n").expect("write");
        assert!(matches!(
            ApiKeys::from_file(&path),
            Err(ApiKeysFileError::Empty { .. })
        ));
    }

    #[test]
    fn interceptor_answers_unauthenticated() {
        let mut i = ApiKeys::new(["k"]).interceptor();
        let refused = i.call(tonic::Request::new(())).expect_err("no key");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(refused.message().contains("missing API key"));
        let mut req = tonic::Request::new(());
        req.metadata_mut()
            .insert("authorization", "Bearer k".parse().expect("ascii"));
        assert!(i.call(req).is_ok());
    }
}
