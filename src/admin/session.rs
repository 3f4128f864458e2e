//! Who the admin listener admits: the bearer token, or a browser session opened with it.
//!
//! A browser cannot be made to send an `Authorization` header on navigation, so the console
//! logs in once (`POST /v1/login` with the token, [`LOGIN_PATH`]) and gets a session cookie:
//! `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page, link or form
//! sends it), `Path=/`, `Secure` when the listener speaks TLS, for [`SESSION_HOURS`] hours.
//! The cookie is a random 256-bit id, not the token: a logout (`POST /v1/logout`) ends it on the
//! server, and a leaked cookie is worth one session. Sessions live in memory (a restart ends
//! them all), at most [`MAX_SESSIONS`], the oldest dropped first.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{json_body, ApiError, Body};

/// The path that opens a session: `POST` `{"token": "<admin.token>"}`.
pub const LOGIN_PATH: &str = "/v1/login";
/// The path that ends the caller's session: `POST` `{}`.
pub const LOGOUT_PATH: &str = "/v1/logout";
/// The session cookie's name, followed by `_<port>` (the port in `Host`) when there is one.
pub const COOKIE: &str = "tollgate_admin_session";
/// How long after a failed login the next one is refused (`429`).
const LOGIN_BACKOFF: Duration = Duration::from_secs(1);
/// How long a session lasts, in hours.
pub const SESSION_HOURS: u64 = 12;
/// Sessions kept at once; the oldest goes when one more opens.
pub const MAX_SESSIONS: usize = 256;

/// The token and the sessions opened with it.
pub(crate) struct Sessions {
    token: Option<Vec<u8>>,
    secure: bool,
    open: Mutex<HashMap<String, Instant>>,
    /// When a login last failed.
    last_failure: Mutex<Option<Instant>>,
}

impl Sessions {
    /// Admits with `token` (none: everybody; empty: nobody); cookies marked `Secure` when
    /// `secure`.
    pub(crate) fn new(token: Option<String>, secure: bool) -> Sessions {
        Sessions {
            token: token.map(String::into_bytes),
            secure,
            open: Mutex::new(HashMap::new()),
            last_failure: Mutex::new(None),
        }
    }

    /// Whether a token is configured (else every request is admitted).
    pub(crate) fn token_required(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `given` is the token, compared in constant time; never with an empty token.
    pub(crate) fn is_token(&self, given: &[u8]) -> bool {
        self.token
            .as_deref()
            .is_some_and(|expected| !expected.is_empty() && constant_time_eq(given, expected))
    }

    /// Whether `headers` carry the token as a bearer, or a live session's cookie (always, when
    /// no token is configured).
    pub(crate) fn admits(&self, headers: &HeaderMap) -> bool {
        if self.token.is_none() {
            return true;
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| bearer_token(v.as_bytes()));
        if bearer.is_some_and(|given| self.is_token(given)) {
            return true;
        }
        session_ids(headers).any(|id| self.is_live(id))
    }

    fn is_live(&self, id: &str) -> bool {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        match open.get(id) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                open.remove(id);
                false
            }
            None => false,
        }
    }

    /// Opens a session for a browser that reached the listener as `headers` say, and returns
    /// its `Set-Cookie` value; `None` when the system's random source fails.
    pub(crate) fn open(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).ok()?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let lifetime = Duration::from_secs(SESSION_HOURS * 3600);
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        open.retain(|_, until| *until > now);
        if open.len() >= MAX_SESSIONS {
            if let Some(oldest) = open.iter().min_by_key(|(_, until)| **until).map(|(k, _)| k.clone()) {
                open.remove(&oldest);
            }
        }
        open.insert(id.clone(), now + lifetime);
        drop(open);
        let secure = if self.secure { "; Secure" } else { "" };
        HeaderValue::try_from(format!(
            "{}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{secure}",
            cookie_name(headers),
            lifetime.as_secs()
        ))
        .ok()
    }

    /// Ends the session `headers` carry, if any, and returns the `Set-Cookie` value that
    /// clears it in the browser.
    pub(crate) fn close(&self, headers: &HeaderMap) -> HeaderValue {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        for id in session_ids(headers) {
            open.remove(id);
        }
        drop(open);
        let secure = if self.secure { "; Secure" } else { "" };
        HeaderValue::try_from(format!(
            "{}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{secure}",
            cookie_name(headers)
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("tollgate_admin_session=; Max-Age=0"))
    }

    /// Whether a login may be tried now: not within a second of a failed one, so the token
    /// cannot be guessed faster than once a second, and failures log at most a line a second.
    fn may_try(&self) -> bool {
        let last = self.last_failure.lock().unwrap_or_else(PoisonError::into_inner);
        !last.is_some_and(|at| at.elapsed() < LOGIN_BACKOFF)
    }

    /// Notes a failed login.
    fn failed(&self) {
        *self.last_failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }
}

/// The ids of every session cookie the request carries. Every one is tried: a browser sends
/// the cookies of all the host's ports, and a page on another port can plant one of the same
/// name on a longer path, which the browser then sends first.
fn session_ids(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| name.starts_with(COOKIE))
        .map(|(_, id)| id)
        .filter(|id| !id.is_empty())
}

/// The cookie's name for a browser that reached the listener as `headers` say:
/// `tollgate_admin_session_<port>` with the port of `Host`, so the sessions of two listeners a
/// browser reaches on one host (two port-forwards) do not replace each other's cookie.
fn cookie_name(headers: &HeaderMap) -> String {
    let port = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.rsplit_once(':'))
        .map(|(_, port)| port)
        .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    match port {
        Some(port) => format!("{COOKIE}_{port}"),
        None => COOKIE.to_owned(),
    }
}

/// The body of `POST /v1/login`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoginRequest {
    token: String,
}

/// `POST /v1/login`: `204` with the session cookie for the right token, `401` for a wrong
/// one (logged, without what was sent), `400` when no token is configured (nothing to log in
/// to).
pub(super) async fn login(sessions: Arc<Sessions>, headers: HeaderMap, body: Body) -> Response {
    let asked: LoginRequest = match json_body(&headers, body) {
        Ok(asked) => asked,
        Err(e) => return e.into_response(),
    };
    if !sessions.token_required() {
        return ApiError::bad_request("no admin.token is set: the listener admits every request without one")
            .into_response();
    }
    if !sessions.may_try() {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "a login failed less than a second ago: try again in a second",
        )
        .into_response();
    }
    if !sessions.is_token(asked.token.as_bytes()) {
        sessions.failed();
        tracing::warn!("admin login refused: wrong token");
        return ApiError::new(StatusCode::UNAUTHORIZED, "wrong token").into_response();
    }
    match sessions.open(&headers) {
        Some(cookie) => {
            tracing::info!("admin session opened");
            (StatusCode::NO_CONTENT, [(header::SET_COOKIE, cookie)]).into_response()
        }
        None => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "no random source for a session id").into_response(),
    }
}

/// `POST /v1/logout`: ends the caller's session (`204`, the cookie cleared).
pub(super) async fn logout(sessions: Arc<Sessions>, headers: HeaderMap, body: Body) -> Response {
    if let Err(e) = json_body::<serde_json::Value>(&headers, body) {
        return e.into_response();
    }
    (StatusCode::NO_CONTENT, [(header::SET_COOKIE, sessions.close(&headers))]).into_response()
}

/// The token of an `Authorization: Bearer <token>` value (the scheme is case-insensitive).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = value[SCHEME.len()..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `given` equals `expected`, in a time that depends on the length of `given` alone
/// (which the client knows anyway): every byte is compared, and nothing tells how many
/// matched or how long `expected` is.
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = given.len() ^ expected.len();
    let n = expected.len().max(1);
    for (i, g) in given.iter().enumerate() {
        let e = expected.get(i % n).copied().unwrap_or(0);
        diff |= usize::from(g ^ e);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn a_session_admits_until_it_is_closed() {
        let sessions = Sessions::new(Some("secret".into()), false);
        assert!(!sessions.admits(&HeaderMap::new()));
        let cookie = sessions.open(&HeaderMap::new()).unwrap();
        let cookie = cookie.to_str().unwrap();
        assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && !cookie.contains("Secure"));
        let id = cookie.split(';').next().unwrap();
        let headers = with_cookie(&format!("other=1; {id}"));
        assert!(sessions.admits(&headers));
        assert!(
            !sessions.admits(&with_cookie(&format!("{COOKIE}=0123"))),
            "an unknown id"
        );
        let cleared = sessions.close(&headers);
        assert!(cleared.to_str().unwrap().contains("Max-Age=0"));
        assert!(!sessions.admits(&headers), "closed");
    }

    #[test]
    fn the_bearer_token_admits_and_an_empty_token_admits_nobody() {
        let sessions = Sessions::new(Some("secret".into()), true);
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer secret"));
        assert!(sessions.admits(&headers));
        assert!(sessions
            .open(&HeaderMap::new())
            .unwrap()
            .to_str()
            .unwrap()
            .ends_with("; Secure"));
        let nobody = Sessions::new(Some(String::new()), false);
        assert!(!nobody.is_token(b""));
        assert!(Sessions::new(None, false).admits(&HeaderMap::new()));
    }

    #[test]
    fn a_planted_cookie_does_not_hide_the_live_one() {
        let sessions = Sessions::new(Some("secret".into()), false);
        let mut host = HeaderMap::new();
        host.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8082"));
        let cookie = sessions.open(&host).unwrap();
        let pair = cookie.to_str().unwrap().split(';').next().unwrap().to_owned();
        assert!(pair.starts_with("tollgate_admin_session_8082="), "{pair}");
        // What a page on another port of the host can set, sent first by the browser.
        let mut headers = with_cookie(&format!("{COOKIE}_8082=junk; {COOKIE}=other; {pair}"));
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8082"));
        assert!(sessions.admits(&headers));
        assert!(sessions
            .close(&headers)
            .to_str()
            .unwrap()
            .starts_with("tollgate_admin_session_8082=;"));
        assert!(!sessions.admits(&headers), "closed, whichever cookie came first");
    }

    #[test]
    fn a_failed_login_holds_the_next_one_off_for_a_second() {
        let sessions = Sessions::new(Some("secret".into()), false);
        assert!(sessions.may_try());
        sessions.failed();
        assert!(!sessions.may_try());
        *sessions.last_failure.lock().unwrap() = Instant::now().checked_sub(LOGIN_BACKOFF);
        assert!(sessions.may_try());
    }

    #[test]
    fn sessions_are_bounded() {
        let sessions = Sessions::new(Some("secret".into()), false);
        let first = sessions.open(&HeaderMap::new()).unwrap();
        let first = with_cookie(first.to_str().unwrap().split(';').next().unwrap());
        for _ in 0..MAX_SESSIONS {
            sessions.open(&HeaderMap::new()).unwrap();
        }
        assert_eq!(sessions.open.lock().unwrap().len(), MAX_SESSIONS);
        assert!(!sessions.admits(&first), "the oldest went");
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b""), None);
    }

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret2", b"secret"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(
            !constant_time_eq(b"secretsecret", b"secret"),
            "a repeat is not the token"
        );
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"x", b""));
    }
}
