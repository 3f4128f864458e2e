//! The overview: where the rules come from and whether the last load failed, the traffic as a
//! chart, the most-denied buckets, and each domain's buckets and rules (read from the
//! `/config` document, so the page shows what `/config` says).

use std::hash::BuildHasher;

use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use serde_json::Value;

use super::chart::{number, Chart, Series};
use super::page::{frame, html_response, link, Section};
use super::Console;
use crate::telemetry::denials::{DeniedInstance, Tally, TOP_DENIED};

/// Where the traffic chart is redrawn from.
pub(super) const RATES_FRAGMENT: &str = "/fragments/rates";

/// Most-denied instances shown.
const TOP: usize = 10;

/// Rules shown per domain; the rest are counted (`/config` has them all).
const RULES_SHOWN: usize = 200;

/// Domains shown with their buckets and rules; the rest by name, so a page stays readable
/// (and quick to render) with thousands of domains.
const DOMAINS_SHOWN: usize = 50;

pub(super) async fn page<S>(console: &Console<S>) -> Response {
    let config = console.config().await;
    let body = html! {
        (status(&config))
        section.card #traffic {
            h2 { "Traffic" }
            div data-refresh=(RATES_FRAGMENT) { (rates_chart(console)) }
        }
        (most_denied(console))
        @if let Some(domains) = config["domains"].as_object() {
            @if domains.is_empty() {
                section.card { p { "No rules are in force." } }
            }
            @for (name, domain) in domains.iter().take(DOMAINS_SHOWN) {
                (domain_card(name, domain))
            }
            @if domains.len() > DOMAINS_SHOWN {
                section.card #more-domains {
                    p { (domains.len() - DOMAINS_SHOWN) " more domains, by name (" code { "GET /config" } " has their rules):" }
                    p.mono { @for name in domains.keys().skip(DOMAINS_SHOWN) { (name) " " } }
                }
            }
        }
    };
    frame(Section::Overview, "Overview", console.logout, StatusCode::OK, body)
}

/// The traffic chart alone, for the page's script to redraw.
pub(super) fn rates_fragment<S>(console: &Console<S>) -> Response {
    html_response(StatusCode::OK, rates_chart(console))
}

fn rates_chart<S>(console: &Console<S>) -> Markup {
    let rates = console.rates.per_second();
    let end = rates.last().map_or(0.0, |r| r.at_s as f64);
    let start = end - super::rates::SAMPLES as f64;
    let series = |class, label, pick: fn(&super::rates::Rate) -> f64| Series {
        class,
        label,
        points: rates.iter().map(|r| (r.at_s as f64, pick(r))).collect(),
    };
    let x_ticks = (0..=5)
        .map(|i| {
            let minutes = 5 - i;
            let label = if minutes == 0 {
                "now".to_owned()
            } else {
                format!("-{minutes} min")
            };
            (start + f64::from(i) * 60.0, label)
        })
        .collect();
    let (answered, denied) = crate::telemetry::denials::ANSWERS.totals();
    let last = rates.last();
    html! {
        (Chart {
            id: "rates",
            title: "Decisions and denials per second, the last five minutes",
            x_range: (start, end),
            y_floor: 1.0,
            y_unit: "per second",
            series: vec![
                series("decisions", "decisions/s", |r| r.decisions),
                series("denials", "denials (OVER_LIMIT)/s", |r| r.denials),
            ],
            x_ticks,
            markers: vec![],
        }.render())
        p.muted {
            "Now " (number(last.map_or(0.0, |r| r.decisions))) " decisions/s, "
            (number(last.map_or(0.0, |r| r.denials))) " denials/s; since start "
            (answered) " answered, " (denied) " denied (the gRPC " code { "ShouldRateLimit" } " answers of this replica)."
        }
    }
}

/// Where the rules come from, their generation, and the last failure to load new ones.
fn status(config: &Value) -> Markup {
    let reload = &config["reload"];
    let source = &config["rules_source"];
    let generation = reload["generation"].as_u64().unwrap_or(0);
    html! {
        section.card #status {
            h2 { "Rules" }
            @match source["kind"].as_str() {
                Some("xds") => p {
                    "From the xDS server " code { (text(&source["server"])) } " (node " code { (text(&source["node"])) } "), "
                    @if source["connected"].as_bool() == Some(true) { span.ok { "connected" } } @else { span.over { "not connected" } }
                    "; version in force " code { (text(&source["version"])) } "."
                    @if let Some(error) = source["last_error"].as_object() {
                        br; span.muted { "Last stream error " (when(&error["at_unix_seconds"])) ": " (text(&error["error"])) }
                    }
                },
                _ => p { "From files at " code { (text(&source["path"])) } ", reloaded on change and on SIGHUP." },
            }
            @if let Some(failure) = reload["last_failure"].as_object() {
                div.failure #reload-failure {
                    strong { "The last load failed " (when(&failure["at_unix_seconds"])) "; generation " (generation) " stays in force:" }
                    ul {
                        @for problem in failure["problems"].as_array().into_iter().flatten() {
                            li { code { (text(problem)) } }
                        }
                    }
                }
            } @else {
                div.fine { "Generation " (generation) " in force; the last load succeeded." }
            }
        }
    }
}

fn most_denied<S>(console: &Console<S>) -> Markup {
    let top = TOP_DENIED.top(TOP);
    html! {
        section.card #denied {
            h2 { "Most-denied buckets" }
            @if top.is_empty() {
                p.muted { "No request was denied since start." }
            } @else {
                table {
                    thead { tr { th { "Domain" } th { "Bucket" } th { "Descriptor" } th { "Denials" } } }
                    tbody {
                        @for (instance, tally) in &top {
                            (denied_row(console, instance, *tally))
                        }
                    }
                }
                p.muted {
                    "A bounded sketch of the " (crate::telemetry::denials::TopDenied::CAPACITY)
                    " instances denied most since start; a count marked ≤ may include up to that many denials of instances it replaced."
                    @if !console.show_values {
                        " Values are masked (" code { "admin.console.show_values" } "); the digest tells instances apart and changes at every restart."
                    }
                }
            }
        }
    }
}

fn denied_row<S>(console: &Console<S>, instance: &DeniedInstance, tally: Tally) -> Markup {
    let entries: Vec<String> = instance
        .entries
        .iter()
        .map(|(key, value)| match console.show_values {
            true => format!("{key}={value}"),
            false => format!(
                "{key}=•••• #{:06x}",
                console.mask_key.hash_one((key, value)) & 0xff_ffff
            ),
        })
        .collect();
    let shown = entries.join(", ");
    let explain = console.show_values.then(|| {
        let entries: Vec<_> = instance
            .entries
            .iter()
            .map(|(key, value)| crate::admin::DescriptorEntry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect();
        let text = super::page::descriptor_text(&entries)?;
        Some(link("/explain", &[("domain", &instance.domain), ("descriptor", &text)]))
    });
    html! {
        tr {
            td { (instance.domain) }
            td { code { (instance.bucket) } }
            td.mono {
                @match explain.flatten() {
                    Some(href) => a href=(href) { (shown) },
                    None => (shown),
                }
            }
            td {
                @if tally.error > 0 { "≤ " }
                (tally.count)
            }
        }
    }
}

fn domain_card(name: &str, domain: &Value) -> Markup {
    let buckets = domain["buckets"].as_array().map(Vec::as_slice).unwrap_or_default();
    let rules = domain["rules"].as_array().map(Vec::as_slice).unwrap_or_default();
    html! {
        section.card.domain data-domain=(name) {
            h2 { "Domain " code { (name) } }
            p.muted { "From " code { (text(&domain["file"])) } "." }
            h3 { "Buckets" }
            table.buckets {
                thead { tr { th { "Bucket" } th { "Kind" } th { "Capacity" } th { "Refill" } th { "Schedule / quota" } th {} } }
                tbody {
                    @for bucket in buckets {
                        (bucket_row(name, bucket))
                    }
                }
            }
            h3 { "Rules" }
            table.rules {
                thead { tr { th { "Rule" } th { "Buckets" } th { "Mode" } th {} } }
                tbody {
                    @for rule in rules.iter().take(RULES_SHOWN) {
                        (rule_row(name, rule))
                    }
                }
            }
            @if rules.len() > RULES_SHOWN {
                p.muted { (rules.len() - RULES_SHOWN) " more rules; " code { "GET /config" } " lists them all." }
            }
        }
    }
}

fn bucket_row(domain: &str, bucket: &Value) -> Markup {
    let name = bucket["name"].as_str().unwrap_or_default();
    let kind = bucket["kind"].as_str().unwrap_or_default();
    let windows = bucket["schedule"].as_array().map_or(0, Vec::len);
    html! {
        tr {
            td { code { (name) } }
            td { (kind.replace('_', " ")) }
            @if kind == "quota" {
                td { (text(&bucket["quota"]["limit"])) }
                td { "none" }
                td { "resets at " code { (text(&bucket["quota"]["reset"])) } " " (text(&bucket["quota"]["timezone"])) }
            } @else {
                td { (text(&bucket["capacity"])) }
                td { (text(&bucket["refill"]["text"])) }
                td {
                    @if windows > 0 { (windows) " schedule window" @if windows > 1 { "s" } }
                    @if let Some(expires) = bucket["expires_seconds"].as_u64() { "whole again " (expires) " s after first use" }
                }
            }
            td { a href=(link("/timeline", &[("domain", domain), ("bucket", name)])) { "timeline" } }
        }
    }
}

fn rule_row(domain: &str, rule: &Value) -> Markup {
    let path = rule["path"].as_str().unwrap_or_default();
    let buckets: Vec<&str> = rule["buckets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    html! {
        tr {
            td { code { (path) } }
            td {
                @if rule["unlimited"].as_bool() == Some(true) { span.tag { "unlimited" } }
                @for b in &buckets { code { (b) } " " }
            }
            td {
                @if rule["shadow_mode"].as_bool() == Some(true) { span.tag { "shadow mode" } }
            }
            td {
                @if !buckets.is_empty() {
                    a href=(link("/timeline", &[("domain", domain), ("rule", path)])) { "timeline" }
                }
            }
        }
    }
}

/// A JSON value as text: a string without quotes, `null` as a dash.
fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "–".to_owned(),
        other => other.to_string(),
    }
}

/// `at <UTC time>` for Unix seconds.
fn when(seconds: &Value) -> String {
    seconds
        .as_i64()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .map_or_else(String::new, |t| format!("at {}", t.format("%Y-%m-%d %H:%M:%S UTC")))
}
