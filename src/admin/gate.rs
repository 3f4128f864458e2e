//! The gate of the admin listener: what every request must pass before its endpoint runs, and
//! the headers every answer carries (the module documentation of `crate::admin` says why).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::session::{Sessions, LOGIN_PATH};
use super::ApiError;

/// What every answer of the admin listener carries, pages and JSON alike: no script, style,
/// image or connection but the listener's own (so an injected tag can load nothing and send
/// nothing elsewhere), no framing (clickjacking), no `Referer` with a deep link's descriptor
/// values, no caching of answers that show bucket state.
pub(super) const SECURITY_HEADERS: [(header::HeaderName, &str); 5] = [
    (
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::X_FRAME_OPTIONS, "DENY"),
    (header::REFERRER_POLICY, "no-referrer"),
    (header::CACHE_CONTROL, "no-store"),
];

/// Adds [`SECURITY_HEADERS`] to every answer, refusals included.
pub(super) async fn secure(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// What every request to the admin listener must pass before its endpoint runs.
pub(super) struct Gate {
    pub(super) sessions: Arc<Sessions>,
    /// Lower case, without a trailing dot.
    pub(super) allowed_hosts: Vec<String>,
    /// [`super::Pages::open_paths`]; the login endpoint is always open (it checks the token
    /// itself).
    pub(super) open_paths: &'static [&'static str],
    /// [`super::Pages::login_page`].
    pub(super) login_page: Option<&'static str>,
}

/// Refuses, before any endpoint, what a browser page could send on an operator's behalf and
/// what lacks the token: a `Host` that is not one of the listener's names (a DNS-rebinding
/// page reaches a loopback listener under its own name, and could read the answers), an
/// `Origin` other than the request's own host (a cross-site page), and, with a token set, a
/// request without it. `POST`s must also be `Content-Type: application/json` (`super::json_body`):
/// a cross-site page can send a form or `text/plain` without asking, JSON only after a CORS
/// preflight, which this listener never grants.
pub(super) async fn admit(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
    let Some(host) = host.filter(|h| gate.host_allowed(h)) else {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "the Host header is not one of the admin listener's names: use an IP address or localhost, \
             or add the name to admin.allowed_hosts",
        )
        .into_response();
    };
    if let Some(origin) = headers.get(header::ORIGIN) {
        let same = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(&host));
        if !same {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "cross-origin requests are refused (the Origin header is not this listener)",
            )
            .into_response();
        }
    }
    let path = request.uri().path();
    if !gate.sessions.admits(headers) && !gate.is_open(path) {
        if let Some(login) = gate
            .login_page
            .filter(|_| request.method() == Method::GET && wants_html(headers))
        {
            return (StatusCode::SEE_OTHER, [(header::LOCATION, login)]).into_response();
        }
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <admin.token>)",
        )
        .into_response();
    }
    next.run(request).await
}

impl Gate {
    /// Whether `authority` (a `Host` value: `name`, `name:port`, `[v6]:port`) names this
    /// listener: an IP address (no DNS name is involved, so no rebinding), `localhost`, or an
    /// [`super::AdminOptions::allowed_hosts`] name. The port is not compared: a port-forward picks
    /// its own, and a rebinding page controls the name, not the port.
    fn host_allowed(&self, authority: &str) -> bool {
        let Some(name) = host_of(authority) else {
            return false;
        };
        let name = normalise_host(name);
        let ip = name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .unwrap_or(&name);
        ip.parse::<std::net::IpAddr>().is_ok() || name == "localhost" || self.allowed_hosts.contains(&name)
    }

    /// Whether `path` is served without the token.
    fn is_open(&self, path: &str) -> bool {
        path == LOGIN_PATH
            || self
                .open_paths
                .iter()
                .any(|open| *open == path || (open.ends_with('/') && path.starts_with(open)))
    }
}

/// Whether a request asks for a page (`Accept` names `text/html`), as a browser's navigation
/// does, rather than JSON.
fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// The host of a `Host` value without its port (`[::1]:8082` -> `[::1]`, `a:1` -> `a`); `None`
/// for an empty one or one with a port that is not a number.
fn host_of(authority: &str) -> Option<&str> {
    let authority = authority.trim();
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (host, rest) = authority.split_at(end + 1);
        (host, rest.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() || port.is_some_and(|p| p.parse::<u16>().is_err()) {
        return None;
    }
    Some(host)
}

/// A host name as compared: lower case, without a trailing dot.
pub(super) fn normalise_host(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// Whether `headers` say the body is JSON (`application/json`, parameters allowed).
pub(super) fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}
