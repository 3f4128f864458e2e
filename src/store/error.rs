//! How a store fails: building or connecting a shared backend ([`ConnectError`]), and deciding
//! ([`StoreError`], whose [`Cause`] keeps the backend client's own error as its source).

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// What went wrong in a backend, as a message and, when the backend's client reported it, that
/// client's error as the [`Error::source`] (a `fred::error::Error`, a `sqlx::Error`), so a
/// caller can inspect it (`downcast_ref`) instead of parsing text. Displays as the message only;
/// [`crate::error_chain`] adds the source when it says more. Cheap to clone (one `Arc`), because a
/// failed batch gives the same failure to every request in it.
#[derive(Clone, Debug)]
pub struct Cause {
    message: String,
    source: Option<Arc<dyn Error + Send + Sync + 'static>>,
}

impl Cause {
    /// A cause that is the client's error `e`: its text is the message, `e` the source.
    pub fn from_error(e: impl Error + Send + Sync + 'static) -> Cause {
        Cause {
            message: e.to_string(),
            source: Some(Arc::new(e)),
        }
    }

    /// The message, without the source.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for Cause {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

/// A cause of tollgate's own, with no client error behind it (a timeout of ours, an answer that
/// does not parse, an open circuit).
impl From<String> for Cause {
    fn from(message: String) -> Cause {
        Cause { message, source: None }
    }
}

impl From<&str> for Cause {
    fn from(message: &str) -> Cause {
        Cause::from(message.to_string())
    }
}

/// Why a shared store (Redis, Postgres) could not be built or connected.
#[derive(Debug, thiserror::Error)]
#[error("{backend} at {url}: {reason}")]
pub struct ConnectError {
    /// `Redis` or `Postgres`.
    pub backend: &'static str,
    /// The (first) URL, password redacted.
    pub url: String,
    /// What went wrong.
    pub reason: String,
}

/// Why a store could not decide a request (or answer a peek or reset).
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached or did not answer in time.
    #[error("backend unavailable: {0}")]
    Unavailable(#[source] Cause),
    /// The backend did not answer within its command timeout.
    #[error("backend timed out: {0}")]
    Timeout(#[source] Cause),
    /// The backend answered, but refused this request: a bucket's stored value is not one
    /// tollgate wrote (another writer under the key prefix, a key of the wrong type). Only the
    /// buckets of this request are affected, so it does not count towards the circuit breaker.
    #[error("backend refused the request: {0}")]
    Rejected(#[source] Cause),
    /// The request shared a backend call with others (a batch), and that call failed with
    /// `.0`. The batch's first request carries the failure itself; the others carry this, which
    /// counts in the metrics as `.0` does but not again towards the circuit breaker, so its
    /// threshold counts failed calls to the backend, however many requests each carried.
    #[error("{0}")]
    InFailedBatch(Box<StoreError>),
    /// One node of a Redis Cluster failed this request's call with `.0` (or is known to be
    /// failing): only the requests whose buckets live on its slots fail. The node's own breaker
    /// counts it; the store-wide one does not, so one lost master does not stop the decisions
    /// of the others. Counted in the metrics as `.0` is.
    #[error("{0}")]
    NodeFailed(Box<StoreError>),
}

impl StoreError {
    /// The failure itself: `.0` of [`StoreError::InFailedBatch`] and [`StoreError::NodeFailed`]
    /// (all the way down), else this.
    pub fn cause(&self) -> &StoreError {
        match self {
            StoreError::InFailedBatch(e) | StoreError::NodeFailed(e) => StoreError::cause(e),
            e => e,
        }
    }
}

/// The answers for the requests of a failed batch call: `error` for the first, and
/// [`StoreError::InFailedBatch`] for the others.
pub fn batch_failure<T>(error: StoreError, requests: usize) -> Vec<Result<T, StoreError>> {
    (0..requests)
        .map(|i| {
            if i == 0 {
                Err(error.clone())
            } else {
                Err(StoreError::InFailedBatch(Box::new(error.clone())))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("connection reset by peer")]
    struct ClientError;

    #[test]
    fn a_client_error_stays_the_source() {
        let e = StoreError::Unavailable(Cause::from_error(ClientError));
        assert_eq!(e.to_string(), "backend unavailable: connection reset by peer");
        let cause = e.source().expect("the cause");
        let client = cause.source().expect("the client's error");
        assert!(client.downcast_ref::<ClientError>().is_some());
        // Said once, not twice, in a chain for a person.
        assert_eq!(crate::error_chain(&e), "backend unavailable: connection reset by peer");
    }

    #[test]
    fn a_failed_batch_shares_the_source() {
        let failed = batch_failure::<()>(StoreError::Timeout(Cause::from_error(ClientError)), 3);
        for r in &failed {
            let Err(e) = r else { panic!("a failure") };
            let StoreError::Timeout(cause) = e.cause() else {
                panic!("a timeout: {e:?}")
            };
            assert!(cause.source().and_then(|s| s.downcast_ref::<ClientError>()).is_some());
        }
        assert!(matches!(failed[1], Err(StoreError::InFailedBatch(_))));
    }

    #[test]
    fn our_own_causes_have_no_source() {
        let e = StoreError::Rejected("negative bucket state".into());
        assert_eq!(e.to_string(), "backend refused the request: negative bucket state");
        assert!(e.source().expect("the cause").source().is_none());
    }
}
