//! One descriptor's buckets, as `POST /v1/buckets/peek` reads them, with refund and reset: the
//! buttons send JSON to `/v1/buckets/refund` and `/v1/buckets/reset` after a confirmation.

use axum::response::Response;
use maud::{html, Markup};

use super::page::{descriptor, descriptor_text, first, frame, link, query_pairs, PageError, Section};
use super::Console;
use crate::admin::{buckets, BucketRequest, BucketsResponse, Operation};
use crate::store::Store;

pub(super) async fn page<S: Store>(console: &Console<S>, query: Option<&str>) -> Response {
    let pairs = query_pairs(query);
    let domain = first(&pairs, "domain").unwrap_or_default().trim().to_owned();
    let given = first(&pairs, "descriptor").unwrap_or_default().to_owned();
    let read = if domain.is_empty() || given.is_empty() {
        None
    } else {
        Some(peek(console, &domain, &given).await)
    };
    let status = PageError::status_of(read.as_ref());
    let body = html! {
        section.card {
            form.query method="get" action="/bucket" {
                label { "Domain" input name="domain" value=(domain) required; }
                label { span { "Descriptor: entries " code { "key=value" } " separated by commas" } input name="descriptor" value=(given) required placeholder="api_key=demo"; }
                div { button type="submit" { "Peek" } }
            }
        }
        @match read {
            Some(Ok(read)) => (buckets_card(&read)),
            Some(Err(e)) => (e.card("bucket-error")),
            None => "",
        }
    };
    frame(Section::Bucket, "Bucket actions", console.logout, status, body)
}

async fn peek<S: Store>(console: &Console<S>, domain: &str, given: &str) -> Result<BucketsResponse, PageError> {
    let request = BucketRequest {
        domain: domain.to_owned(),
        descriptor: descriptor(given).map_err(PageError::bad_request)?,
        hits: Some(1),
        tokens: None,
    };
    buckets(&console.limiter, Operation::Peek, request)
        .await
        .map_err(PageError::from)
}

fn buckets_card(read: &BucketsResponse) -> Markup {
    let address = serde_json::json!({ "domain": read.domain, "descriptor": read.descriptor }).to_string();
    let explain = descriptor_text(&read.descriptor)
        .map(|text| link("/explain", &[("domain", &read.domain), ("descriptor", &text)]));
    html! {
        section.card #buckets {
            p #flash.fine hidden {}
            p {
                "Rule " code { (read.rule) } @if read.shadow { " " span.tag { "shadow mode" } }
                "."
                @if let Some(href) = explain { " " a href=(href) { "Explain a request" } }
            }
            table.buckets {
                thead { tr { th { "Bucket" } th { "Kind" } th { "Tokens" } th { "Refill" } th { "Full in" } th { "A hit passes in" } } }
                tbody {
                    @for b in &read.buckets {
                        tr data-bucket=(b.name) {
                            td { code { (b.name) } }
                            td { (kind_name(b.kind)) }
                            td.tokens { (b.tokens) " / " (b.capacity) }
                            td { (super::page::refill(b.limit.refill_per_second)) }
                            td { @match b.full_in_seconds { Some(0) => "full", Some(s) => { (s) " s" }, None => "never" } }
                            td { @match b.retry_after.and_then(|r| r.seconds) { Some(0) => "now", Some(s) => { (s) " s" }, None => "never" } }
                        }
                    }
                }
            }
            h3 { "Refund" }
            form.action #refund data-post=(Operation::Refund.path()) data-body=(address) data-then="reload" data-done="Refunded" {
                label { "Tokens to give back to each bucket" input name="tokens" type="number" min="1" value="1" data-field="tokens"; }
                button.ask type="button" { "Refund…" }
                div.confirm hidden {
                    "Give these tokens back to every bucket above (never above its capacity)?"
                    button.yes type="submit" { "Confirm refund" }
                    button.cancel type="button" { "Cancel" }
                }
                output {}
            }
            h3 { "Reset" }
            form.action #reset data-post=(Operation::Reset.path()) data-body=(address) data-then="reload" data-done="Reset" {
                button.ask.danger type="button" { "Reset…" }
                div.confirm hidden {
                    "Make every bucket above full again, as if never used?"
                    button.yes.danger type="submit" { "Confirm reset" }
                    button.cancel type="button" { "Cancel" }
                }
                output {}
            }
            p.muted { "Refunds and resets are logged with the domain, rule and bucket names (never the values)." }
        }
    }
}

/// `token bucket`, `scheduled`, `quota` or `expiring allowance`.
fn kind_name(kind: crate::admin::PlanKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(|s| s.replace('_', " ")))
        .unwrap_or_default()
}
