//! The explain page: a form, and the answer of `POST /v1/explain` for the request it (or a
//! deep link, `/explain?domain=edge&descriptor=api_key=demo`) describes, as a person reads it.

use axum::response::Response;
use maud::{html, Markup};

use super::page::{descriptor_text, descriptors, first, frame, link, query_pairs, PageError, Section};
use super::Console;
use crate::admin::explain::{explain, DescriptorView, ExplainDescriptor, ExplainRequest, ExplainResponse};
use crate::admin::DescriptorEntry;
use crate::store::Store;

pub(super) async fn page<S: Store>(console: &Console<S>, query: Option<&str>) -> Response {
    let pairs = query_pairs(query);
    let domain = first(&pairs, "domain").unwrap_or_default().trim().to_owned();
    let hits = first(&pairs, "hits").unwrap_or("1").trim().to_owned();
    let given: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "descriptor")
        .flat_map(|(_, v)| v.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned))
        .collect();
    let answer = if domain.is_empty() {
        None
    } else {
        Some(ask(console, &domain, &pairs, &hits).await)
    };
    let status = PageError::status_of(answer.as_ref());
    let body = html! {
        section.card {
            form.query method="get" action="/explain" {
                label { "Domain" input name="domain" value=(domain) required; }
                label {
                    span { "Descriptors: one a line, entries " code { "key=value" } " separated by commas" }
                    textarea name="descriptor" rows="3" placeholder="api_key=demo" { (given.join("\n")) }
                }
                label { "Hits (hits_addend)" input name="hits" type="number" min="0" value=(hits); }
                div { button type="submit" { "Explain" } }
            }
            p.muted { "Explaining consumes nothing: it reads the buckets as a decision would and answers what "
                code { "ShouldRateLimit" } " would answer now." }
        }
        @match answer {
            Some(Ok((answer, asked))) => (result(&answer, &asked)),
            Some(Err(e)) => (e.card("explain-error")),
            None => "",
        }
    };
    frame(Section::Explain, "Explain a request", console.logout, status, body)
}

async fn ask<S: Store>(
    console: &Console<S>,
    domain: &str,
    pairs: &[(String, String)],
    hits: &str,
) -> Result<(ExplainResponse, Vec<Vec<DescriptorEntry>>), PageError> {
    let hits: u32 = hits
        .parse()
        .map_err(|_| PageError::bad_request(format!("hits `{hits}` is not a whole number of at most {}", u32::MAX)))?;
    let asked = descriptors(pairs).map_err(PageError::bad_request)?;
    let descriptors = asked
        .iter()
        .map(|entries| ExplainDescriptor {
            entries: entries.clone(),
            ..ExplainDescriptor::default()
        })
        .collect();
    let request = ExplainRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: hits,
    };
    let answer = explain(&console.limiter, request).await.map_err(PageError::from)?;
    Ok((answer, asked))
}

/// The descriptor and bucket that decide the answer: the first descriptor answered
/// `OVER_LIMIT` (else the first with a deciding bucket), and its deciding bucket.
fn deciding(answer: &ExplainResponse) -> Option<(&DescriptorView, &crate::admin::explain::ExplainedBucket)> {
    let over = answer
        .descriptors
        .iter()
        .zip(&answer.statuses)
        .find(|(_, s)| s.code == "OVER_LIMIT")
        .map(|(d, _)| d);
    let descriptor = over.or_else(|| answer.descriptors.iter().find(|d| d.deciding.is_some()))?;
    let name = descriptor.deciding.as_deref()?;
    let bucket = descriptor.buckets.iter().find(|b| b.bucket.name == name)?;
    Some((descriptor, bucket))
}

fn result(answer: &ExplainResponse, asked: &[Vec<DescriptorEntry>]) -> Markup {
    let over = answer.overall_code == "OVER_LIMIT";
    let passes = match answer.passes_in_seconds {
        Some(0) => "It passes now.".to_owned(),
        Some(s) => format!("It passes in {s} s."),
        None => "No wait lets it pass (it asks more than a bucket can hold, or a bucket never refills).".to_owned(),
    };
    html! {
        section.card #explain-result {
            div.verdict.over[over].ok[!over] #verdict { (answer.overall_code) }
            @if let Some((_, bucket)) = deciding(answer) {
                p #deciding {
                    "Decided by bucket " strong #deciding-bucket { (bucket.bucket.name) } ": "
                    span #tokens-left { (bucket.bucket.tokens) } " of " (bucket.bucket.capacity) " tokens left. "
                }
            }
            p #passes-in { (passes) }
            @for (i, (d, status)) in answer.descriptors.iter().zip(&answer.statuses).enumerate() {
                (descriptor_section(answer, i, d, &status.code, asked.get(i)))
            }
            @if !answer.response_headers.is_empty() {
                h3 { "Headers Envoy adds to the client's response" }
                pre { @for h in &answer.response_headers { (h.key) ": " (h.value) "\n" } }
            }
            @if !answer.request_headers.is_empty() {
                h3 { "Headers Envoy adds to the request sent upstream" }
                pre { @for h in &answer.request_headers { (h.key) ": " (h.value) "\n" } }
            }
            @for m in &answer.malformed {
                p.error { "Malformed (" (m.reason) "): " (m.note) }
            }
            details {
                summary { "As text (" code { "tollgate explain" } ")" }
                pre { (answer.summary()) }
            }
        }
    }
}

fn descriptor_section(
    answer: &ExplainResponse,
    i: usize,
    d: &DescriptorView,
    code: &str,
    entries: Option<&Vec<DescriptorEntry>>,
) -> Markup {
    html! {
        h3 {
            "Descriptor " (i) ": "
            span class=(if code == "OVER_LIMIT" { "over" } else { "ok" }) { (code) }
        }
        p {
            (reached(d))
            @if d.shadow { " " span.tag { "shadow mode" } }
            @if d.quota_mode { " " span.tag { "quota mode" } }
        }
        @if !d.buckets.is_empty() {
            table.buckets {
                thead { tr { th { "Bucket" } th { "Tokens" } th { "Refill" } th { "Asks" } th { "Verdict" } th { "Passes in" } th { "Window" } } }
                tbody {
                    @for b in &d.buckets {
                        tr.deciding[d.deciding.as_deref() == Some(b.bucket.name.as_str())] {
                            td { code { (b.bucket.name) } @if b.hidden { " " span.tag { "hidden" } } }
                            td { (b.bucket.tokens) " / " (b.bucket.capacity) }
                            td { (super::page::refill(b.bucket.limit.refill_per_second)) }
                            td { (b.asked) " (" (b.demand) ")" }
                            td {
                                @if b.passed { span.ok { "passes" } }
                                @else if b.enforced { span.over { "denies" } }
                                @else { span.muted { "over, not enforced" } }
                            }
                            td {
                                @match (b.passed, b.passes_in_seconds) {
                                    (true, _) => "–",
                                    (false, Some(s)) => { (s) " s" },
                                    (false, None) => "never",
                                }
                            }
                            td { @if let Some(w) = &b.window { code { (w.cron) } " " (w.timezone) } @else { "base" } }
                        }
                    }
                }
            }
            @if let Some(text) = entries.and_then(|e| descriptor_text(e)) {
                p { a.bucket-actions href=(link("/bucket", &[("domain", &answer.domain), ("descriptor", &text)])) { "Bucket actions: peek, refund, reset" } }
            }
        }
    }
}

fn reached(d: &DescriptorView) -> Markup {
    html! {
        @match d.found.as_str() {
            "rule" => { "Rule " code { (d.rule.as_deref().unwrap_or_default()) } },
            "unlimited" => { "Unlimited rule " code { (d.rule.as_deref().unwrap_or_default()) } ": no bucket." },
            "replaced" => { "Rule " code { (d.rule.as_deref().unwrap_or_default()) } ", dropped by another rule's " code { "replaces" } "." },
            "no_rule" => {
                "No rule matched. "
                @if let Some(f) = &d.failed_entry {
                    "Entry " (f.index) " (" code { (f.key) } ") matched nothing "
                    @match &d.nearest { Some(n) => { "below " code { (n) } }, None => "at the top of the tree" }
                    "."
                } @else if let Some(n) = &d.nearest {
                    "Every entry matched, but " code { (n) } " has no limit of its own."
                }
            },
            "override" => "Envoy's limit override decides it.",
            "unknown_domain" => "The domain has no rules.",
            other => (other.replace('_', " ")),
        }
    }
}
