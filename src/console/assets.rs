//! The console's stylesheet and script, compiled into the binary: the console works with no
//! network, and nothing it loads comes from anywhere but the admin listener.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

/// Where the stylesheet is served.
pub(crate) const CSS_PATH: &str = "/assets/console.css";
/// Where the script is served.
pub(crate) const JS_PATH: &str = "/assets/console.js";
/// Where the icon is served.
pub(crate) const ICON_PATH: &str = "/assets/icon.svg";

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");
const ICON: &str = include_str!("assets/icon.svg");

/// The stylesheet.
pub(crate) async fn css() -> Response {
    asset(CSS, "text/css; charset=utf-8")
}

/// The script.
pub(crate) async fn js() -> Response {
    asset(JS, "text/javascript; charset=utf-8")
}

/// The icon.
pub(crate) async fn icon() -> Response {
    asset(ICON, "image/svg+xml")
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
