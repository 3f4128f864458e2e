//! The operator console (`src/console/`, docs/console.md) on a real `tollgate serve`.
//!
//! - Over HTTP: every page carries the strict `Content-Security-Policy`; without a session a
//!   browser is sent to `/login` and the API answers `401`; the login page and assets are open;
//!   a login sets an `HttpOnly`, `SameSite=Strict` cookie that admits pages and API calls until
//!   logout; a login or action from another origin is refused; client-controlled text (rule
//!   values, descriptor values in a deep link) is escaped; the console can be turned off.
//! - In a real browser (`tests/browser/console.py`: Debian's Chromium driven by Playwright,
//!   installed by `scripts/ensure-browser`): the token flow, the overview's rules and chart, the
//!   explain deep link of a drained bucket (`OVER_LIMIT`, the bucket, when it passes; a second
//!   explain leaves it unchanged), bucket actions behind their confirmation, the timeline, no
//!   request leaving the admin listener, and a cross-site page that cannot act. It takes the
//!   screenshots docs/console.md shows (`TOLLGATE_UPDATE_SCREENSHOTS=1` writes them to
//!   `docs/console/`).

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use support::Tollgate;

const TOKEN: &str = "console-test-token";

/// A bucket to drain (3 an hour), a schedule in New York, a daily quota in Berlin, and a rule
/// whose value is markup.
const RULES: &str = r#"
domain: edge
buckets:
  per_key:
    capacity: 3
    refill: 3/1h
  business_hours:
    capacity: 100
    refill: 10/s
    schedule:
      - cron: "* 9-16 * * MON-FRI"
        timezone: America/New_York
        scale: 0.5
  daily:
    quota: {limit: 1000, reset: "0 0 * * *", timezone: Europe/Berlin}
descriptors:
  - {key: api_key, bucket: per_key}
  - {key: tenant, bucket: business_hours}
  - {key: plan, bucket: daily}
  - {key: path, value: "<img src=x onerror=alert(1)>", bucket: per_key}
"#;

/// The first three rules of [`RULES`], for the browser test (its screenshots are the docs').
fn browser_rules() -> String {
    RULES
        .lines()
        .filter(|l| !l.contains("<img"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn start(token: bool, extra_env: &[(&str, &str)]) -> Tollgate {
    start_with(RULES, token, extra_env)
}

fn start_with(rules: &str, token: bool, extra_env: &[(&str, &str)]) -> Tollgate {
    let mut builder = Tollgate::builder().rules_file("edge.yaml", rules);
    if token {
        builder = builder.env("TOLLGATE_ADMIN__TOKEN", TOKEN);
    }
    for (k, v) in extra_env {
        builder = builder.env(k, v);
    }
    builder.start()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The text of `path` on the admin listener `admin` (no token).
async fn page_text(admin: std::net::SocketAddr, path: &str) -> String {
    let answer = client().get(format!("http://{admin}{path}")).send().await.unwrap();
    answer.text().await.unwrap()
}

async fn drain(tollgate: &Tollgate) {
    let mut grpc = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .unwrap();
    let demo = || RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![support::descriptor(&[("api_key", "demo")])],
        hits_addend: 1,
    };
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(grpc.should_rate_limit(demo()).await.unwrap().into_inner().overall_code);
    }
    let ok = Code::Ok as i32;
    let over = Code::OverLimit as i32;
    assert_eq!(
        codes,
        vec![ok, ok, ok, over, over],
        "3 pass, then the bucket is drained"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_are_guarded_and_carry_a_strict_policy() {
    let tollgate = tokio::task::block_in_place(|| start(true, &[]));
    let admin = format!("http://{}", tollgate.admin_addr);
    let http = client();

    // Without a session: a browser is sent to the login page, the API answers 401.
    let page = http
        .get(format!("{admin}/"))
        .header("Accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 303);
    assert_eq!(page.headers()["location"], "/login");
    let api = http.get(format!("{admin}/explain")).send().await.unwrap();
    assert_eq!(api.status(), 401, "no Accept: text/html, no redirect");
    for open in ["/login", "/assets/console.css", "/assets/console.js"] {
        let answer = http.get(format!("{admin}{open}")).send().await.unwrap();
        assert_eq!(answer.status(), 200, "{open} needs no token");
        let csp = answer.headers()["content-security-policy"].to_str().unwrap().to_owned();
        assert!(
            csp.starts_with("default-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
    }
    let script = http.get(format!("{admin}/assets/console.js")).send().await.unwrap();
    assert!(script.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/javascript"));

    // A wrong token, a form, another origin: no session.
    let login = |body: &'static str, content_type: &'static str, origin: Option<&'static str>| {
        let mut request = http
            .post(format!("{admin}/v1/login"))
            .header("Content-Type", content_type)
            .body(body);
        if let Some(origin) = origin {
            request = request.header("Origin", origin);
        }
        request.send()
    };
    let wrong = login(r#"{"token":"nope"}"#, "application/json", None).await.unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());
    let form = login("token=console-test-token", "application/x-www-form-urlencoded", None)
        .await
        .unwrap();
    assert_eq!(form.status(), 415, "a form cannot log in");
    let foreign = login(
        r#"{"token":"console-test-token"}"#,
        "application/json",
        Some("http://evil.example"),
    )
    .await
    .unwrap();
    assert_eq!(foreign.status(), 403, "another origin cannot log in");
    assert!(foreign.headers().get("set-cookie").is_none());

    // Right after a failure, even the token waits a second (guessing is once a second).
    let held = login(r#"{"token":"console-test-token"}"#, "application/json", None)
        .await
        .unwrap();
    assert_eq!(held.status(), 429);
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // The right token: a session cookie, HttpOnly and SameSite=Strict, not the token.
    let ok = login(r#"{"token":"console-test-token"}"#, "application/json", None)
        .await
        .unwrap();
    assert_eq!(ok.status(), 204);
    let cookie = ok.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && cookie.contains("Path=/"),
        "{cookie}"
    );
    assert!(!cookie.contains(TOKEN), "{cookie}");
    let port = tollgate.admin_addr.port();
    assert!(
        cookie.starts_with(&format!("tollgate_admin_session_{port}=")),
        "named for the port: {cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    // A GET, or a JSON POST of `body`, carrying the session cookie.
    let get = |path: &str| http.get(format!("{admin}{path}")).header("Cookie", &session).send();
    let post = |path: &str, body: &'static str| {
        http.post(format!("{admin}{path}"))
            .header("Cookie", &session)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
    };

    let overview = get("/").await.unwrap();
    assert_eq!(overview.status(), 200);
    let csp = overview.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.starts_with("default-src 'self'"), "{csp}");
    assert_eq!(overview.headers()["x-frame-options"], "DENY");
    let html = overview.text().await.unwrap();
    assert!(html.contains("per_key") && html.contains("business_hours"), "{html}");
    assert!(!html.contains("<img src=x"), "a rule value is escaped: {html}");
    assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;"), "{html}");
    assert!(
        !html.contains("<script>") && !html.contains(" style="),
        "no inline script or style: {html}"
    );

    // The cookie admits the JSON API too (what the page's buttons send).
    let peek = post(
        "/v1/buckets/peek",
        r#"{"domain":"edge","descriptor":[{"key":"api_key","value":"demo"}]}"#,
    )
    .await
    .unwrap();
    assert_eq!(peek.status(), 200);

    // Deep-link values are escaped.
    let xss = get("/explain?domain=edge&descriptor=api_key=%3Cscript%3Ealert(1)%3C/script%3E")
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!xss.contains("<script>alert"), "{xss}");
    assert!(xss.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{xss}");

    // Logout ends the session on the server.
    let out = post("/v1/logout", "{}").await.unwrap();
    assert_eq!(out.status(), 204);
    assert!(out.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    let after = get("/explain").await.unwrap();
    assert_eq!(after.status(), 401, "the old cookie no longer admits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explain_page_names_a_drained_bucket_and_leaves_it_unchanged() {
    let tollgate = tokio::task::block_in_place(|| start(false, &[]));
    drain(&tollgate).await;
    let admin = format!("http://{}", tollgate.admin_addr);
    let http = client();
    let page = || async {
        http.get(format!("{admin}/explain?domain=edge&descriptor=api_key=demo"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let first = page().await;
    assert!(
        first.contains(r#"<div class="verdict over" id="verdict">OVER_LIMIT</div>"#),
        "{first}"
    );
    assert!(
        first.contains(r#"<strong id="deciding-bucket">per_key</strong>"#),
        "{first}"
    );
    assert!(first.contains(r#"<span id="tokens-left">0</span>"#), "{first}");
    let passes = |html: &str| {
        let at = html.find(r#"<p id="passes-in">It passes in "#).expect("a wait");
        html[at..]
            .split(" s.")
            .next()
            .unwrap()
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let wait = passes(&first);
    assert!((1..=1200).contains(&wait), "a token every 20 minutes: {wait}");
    let second = page().await;
    assert!(
        second.contains("OVER_LIMIT") && passes(&second) <= wait,
        "unchanged: {second}"
    );
    let overview = http
        .get(format!("{admin}/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let denied = &overview[overview.find(r#"id="denied""#).unwrap()..];
    assert!(
        denied.contains("per_key") && denied.contains("api_key=•••• #"),
        "masked: {denied}"
    );
    assert!(
        !denied[..denied.find("</section>").unwrap()].contains("demo"),
        "{denied}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_can_be_turned_off_and_values_shown() {
    let off = tokio::task::block_in_place(|| start(false, &[("TOLLGATE_ADMIN__CONSOLE__ENABLED", "false")]));
    let http = client();
    let root = http.get(format!("http://{}/", off.admin_addr)).send().await.unwrap();
    assert_eq!(root.status(), 404, "no pages");
    let shown = tokio::task::block_in_place(|| start(false, &[("TOLLGATE_ADMIN__CONSOLE__SHOW_VALUES", "true")]));
    drain(&shown).await;
    let overview = page_text(shown.admin_addr, "/").await;
    let denied = &overview[overview.find(r#"id="denied""#).unwrap()..];
    assert!(denied.contains("api_key=demo"), "{denied}");
    assert!(
        denied.contains("/explain?domain=edge&amp;descriptor=api_key%3Ddemo"),
        "a deep link: {denied}"
    );
}

/// The Python with Playwright, or `None` to skip: without it (or without `/usr/bin/chromium`)
/// the test fails under `CI=true` and is skipped otherwise.
fn browser_or_skip(test: &str) -> Option<(PathBuf, PathBuf)> {
    let python = std::env::var_os("TOLLGATE_BROWSER_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            let cache = Path::new(&std::env::var_os("HOME")?).join(".cache/tollgate");
            std::fs::read_dir(cache)
                .ok()?
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("playwright-"))
                .map(|e| e.path().join("bin/python"))
                .find(|p| p.is_file())
        })
        .filter(|p| p.is_file());
    let chromium = PathBuf::from(std::env::var_os("TOLLGATE_CHROMIUM").unwrap_or_else(|| "/usr/bin/chromium".into()));
    match (python, chromium.is_file()) {
        (Some(python), true) => Some((python, chromium)),
        _ => {
            let how = "run scripts/ensure-browser (Debian's chromium and Playwright for Python)";
            let ci = std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
            assert!(!ci, "{test}: no Playwright or no /usr/bin/chromium and CI=true: {how}");
            eprintln!("SKIPPED {test}: no Playwright or Chromium ({how})");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_real_browser() {
    let Some((python, chromium)) = browser_or_skip("the_console_in_a_real_browser") else {
        return;
    };
    let tollgate = tokio::task::block_in_place(|| start_with(&browser_rules(), true, &[]));
    drain(&tollgate).await;
    // The traffic chart draws a line once two per-second rates are there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let update = std::env::var("TOLLGATE_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1");
    let shots = if update {
        root.join("docs/console")
    } else {
        tollgate.dir.path().join("screenshots")
    };
    let output = tokio::task::block_in_place(|| {
        std::process::Command::new(&python)
            .arg(root.join("tests/browser/console.py"))
            .env("ADMIN", format!("http://{}", tollgate.admin_addr))
            .env("TOKEN", TOKEN)
            .env("SHOTS", &shots)
            .env("CHROMIUM", &chromium)
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("https_proxy")
            .env_remove("HTTPS_PROXY")
            .output()
            .expect("run tests/browser/console.py")
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the browser checks failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- tollgate\n{}",
        tollgate.process.log_tail(40)
    );
    assert!(stdout.contains("all browser checks passed"), "{stdout}");
    for shot in ["login.png", "overview.png", "explain.png", "bucket.png", "timeline.png"] {
        let size = std::fs::metadata(shots.join(shot)).map(|m| m.len()).unwrap_or(0);
        assert!(size > 10_000, "{shot}: {size} bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_stays_bounded_with_many_domains() {
    let mut builder = Tollgate::builder();
    for i in 0..55 {
        let rules = format!(
            "domain: d{i:02}\ndescriptors:\n  - {{key: k, name: b{i}, token_bucket: {{capacity: 1, refill: 1/s}}}}\n"
        );
        builder = builder.rules_file(&format!("d{i:02}.yaml"), &rules);
    }
    let tollgate = tokio::task::block_in_place(|| builder.start());
    let html = page_text(tollgate.admin_addr, "/").await;
    assert_eq!(html.matches(r#"<section class="card domain""#).count(), 50, "{html}");
    assert!(html.contains("5 more domains"), "{html}");
    assert!(html.contains("d54"), "the rest by name: {html}");
}
