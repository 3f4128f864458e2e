//! The login page: the token, sent once as JSON to `POST /v1/login`, which answers with the
//! session cookie (`crate::admin::session`).

use axum::response::Response;
use maud::html;

use super::page::{frame, Section};
use crate::admin::session::LOGIN_PATH;

/// Where the login page is served.
pub(crate) const LOGIN_PAGE: &str = "/login";

/// The page; `token_required` false says there is nothing to log in to.
pub(super) fn page(token_required: bool) -> Response {
    let body = html! {
        section.card {
            @if token_required {
                p { "This listener is guarded by " code { "admin.token" } ". Enter it to open a session of "
                    (crate::admin::session::SESSION_HOURS) " hours in this browser (an " code { "HttpOnly" } ", "
                    code { "SameSite=Strict" } " cookie; the token itself is not kept)." }
                form.action.login data-post=(LOGIN_PATH) data-body="{}" data-then="/" {
                    label { "Token" input #token type="password" name="token" data-field="token" autocomplete="current-password" required; }
                    button type="submit" { "Log in" }
                    output {}
                }
            } @else {
                p { "No " code { "admin.token" } " is set: the console needs no login. " a href="/" { "Go to the overview" } "." }
            }
        }
    };
    frame(Section::Login, "Log in", false, axum::http::StatusCode::OK, body)
}
