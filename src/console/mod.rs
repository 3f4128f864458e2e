//! The operator console: pages on the admin listener that answer "why was this request
//! limited, and when will it pass?" (docs/console.md).
//!
//! A room beside the admin API, not part of it: the pages read through the admin API's own
//! functions (`crate::admin::explain`, the bucket peek) and the `/config` document, and the
//! page's buttons send JSON to the admin endpoints a `curl` would use, so the console can do
//! nothing the API cannot. Every page is rendered on the server (maud, escaped by default);
//! charts are SVG; the stylesheet and the one small script are compiled into the binary
//! (`assets/`), so the console works with no network. It sits behind the admin listener's gate
//! (`crate::admin::Pages`): the `Host` and `Origin` rules, JSON-only `POST`s, the token as a
//! bearer or a session cookie, and a strict `Content-Security-Policy` on every answer.
//!
//! | page | shows |
//! |---|---|
//! | `/` | the rules source and the last reload failure, decisions and denials per second, the most-denied buckets, each domain's buckets and rules |
//! | `/explain?domain=D&descriptor=k=v,k2=v2&hits=N` | what `ShouldRateLimit` would answer now, the deciding bucket, when the request passes |
//! | `/timeline?domain=D&rule=PATH` (or `&bucket=NAME`) | a rule's buckets' capacity and refill over the next 7 days, a quota's resets |
//! | `/bucket?domain=D&descriptor=k=v` | one descriptor's buckets (a peek), with refund and reset behind a confirmation |
//! | `/login` | the token form, when `admin.token` is set |

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::response::Response;
use axum::routing::get;
use axum::Router;

use crate::admin::{ConfigView, Pages};
use crate::decision::limiter::Limiter;
use crate::store::Store;

mod assets;
mod bucket_page;
mod chart;
mod explain_page;
mod login;
mod overview;
mod page;
mod rates;
pub mod settings;
mod timeline;

pub use settings::ConsoleSettings;

/// What the console shows beyond the limiter.
pub struct ConsoleOptions {
    /// The `/config` document (rules in force, reload status, rules source).
    pub config: ConfigView,
    /// Show the most-denied buckets' descriptor values ([`ConsoleSettings::show_values`]).
    pub show_values: bool,
    /// Whether `admin.token` guards the listener (pages then offer a logout).
    pub token_required: bool,
}

/// Paths served without the token: the login page and the assets (they show nothing of the
/// rules or the buckets).
const OPEN_PATHS: &[&str] = &[login::LOGIN_PAGE, "/assets/"];

/// The console's pages over `limiter`, to serve behind the admin gate
/// ([`crate::admin::AdminOptions::pages`]). Starts sampling the answer counters once a second
/// (a task that ends when the pages are dropped); call within a Tokio runtime.
pub fn pages<S: Store>(limiter: Arc<Limiter<S>>, options: ConsoleOptions) -> Pages {
    let console = Arc::new(Console {
        limiter,
        config: options.config,
        show_values: options.show_values,
        logout: options.token_required,
        rates: rates::Rates::start(),
        mask_key: std::collections::hash_map::RandomState::new(),
    });
    let router = Router::new()
        .route("/", get(overview::<S>))
        .route(overview::RATES_FRAGMENT, get(rates_fragment::<S>))
        .route("/explain", get(explain::<S>))
        .route("/timeline", get(timeline::<S>))
        .route("/bucket", get(bucket::<S>))
        .route(login::LOGIN_PAGE, get(login::<S>))
        .route(assets::CSS_PATH, get(assets::css))
        .route(assets::JS_PATH, get(assets::js))
        .route(assets::ICON_PATH, get(assets::icon))
        .with_state(console);
    Pages {
        router,
        open_paths: OPEN_PATHS,
        login_page: login::LOGIN_PAGE,
    }
}

/// What the pages share.
struct Console<S> {
    limiter: Arc<Limiter<S>>,
    config: ConfigView,
    show_values: bool,
    logout: bool,
    rates: Arc<rates::Rates>,
    /// Keys the digests that tell masked values apart; new at every start, so a digest cannot
    /// be looked up in a table of likely values.
    mask_key: std::collections::hash_map::RandomState,
}

impl<S> Console<S> {
    /// The `/config` document (`null` if building it failed).
    async fn config(&self) -> serde_json::Value {
        crate::admin::config_document(&self.config).await.unwrap_or_default()
    }
}

async fn overview<S: Store>(State(console): State<Arc<Console<S>>>) -> Response {
    overview::page(&console).await
}

async fn rates_fragment<S: Store>(State(console): State<Arc<Console<S>>>) -> Response {
    overview::rates_fragment(&console)
}

async fn explain<S: Store>(State(console): State<Arc<Console<S>>>, RawQuery(query): RawQuery) -> Response {
    explain_page::page(&console, query.as_deref()).await
}

async fn timeline<S: Store>(State(console): State<Arc<Console<S>>>, RawQuery(query): RawQuery) -> Response {
    timeline::page(&console, query.as_deref()).await
}

async fn bucket<S: Store>(State(console): State<Arc<Console<S>>>, RawQuery(query): RawQuery) -> Response {
    bucket_page::page(&console, query.as_deref()).await
}

async fn login<S: Store>(State(console): State<Arc<Console<S>>>) -> Response {
    login::page(console.logout)
}
