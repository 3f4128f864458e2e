//! The operators' kit in `deploy/monitoring/`: the Grafana dashboard, the Prometheus alerting
//! rules, their `promtool` unit tests and the PrometheusRule wrapper.
//!
//! The main check is that every PromQL expression (dashboard panels, template variables,
//! annotations, alerts, the recording rules of docs/monitoring.md) names only series a real
//! tollgate exports, with labels it exports and, for fixed label values (`code="over_limit"`),
//! values it exports; and every legend only labels its query returns. The series are read from
//! the `/metrics` of running tollgates: one on the shared Redis with `failure_mode: fallback`
//! and `fallback: memory` (backend, fallback and memory series) after a request mix that gives
//! every decision code, and one whose Redis never answers, with `failure_mode: allow`
//! (`tollgate_backend_failure_answers_total`, a series that only appears with the first such
//! answer). Prometheus's own `up` is the one series allowed beyond them.

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use serde_json::Value as Json;
use support::{descriptor, request, tools::tool_or_skip, Scrape, Tollgate};
use tokio::task::block_in_place;
use tonic::transport::Channel;

const DASHBOARD: &str = "deploy/monitoring/grafana-dashboard.json";
const ALERTS: &str = "deploy/monitoring/alerts.yaml";
const ALERT_TESTS: &str = "deploy/monitoring/alerts.test.yaml";
const PROMETHEUS_RULE: &str = "deploy/monitoring/prometheusrule.yaml";
const DOC: &str = "docs/monitoring.md";

/// Series that Prometheus itself makes for every target (`TollgateTargetDown` needs one).
const PROMETHEUS_SERIES: &[&str] = &["up"];
/// Labels Prometheus adds to every series it scrapes.
const TARGET_LABELS: &[&str] = &["job", "instance"];

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_file(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

// ---- PromQL: the series an expression selects -----------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    /// A number or a duration (`0.99`, `5m`, `1e-9`): never a name.
    Number,
    /// A Grafana variable (`$instance`, `${bucket}`, `$__rate_interval`).
    Var,
    Punct(&'static str),
}

const PUNCTS: &[&str] = &[
    "=~", "!~", "!=", "==", "<=", ">=", "(", ")", "{", "}", "[", "]", ",", "=", "<", ">", "+", "-", "*", "/", "%", "^",
    "@", ":",
];

fn lex(expr: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            let mut value = String::new();
            i += 1;
            loop {
                let Some(&d) = chars.get(i) else {
                    return Err(format!("unterminated string in {expr}"));
                };
                i += 1;
                if d == c {
                    break;
                }
                if d == '\\' && c != '`' {
                    let Some(&e) = chars.get(i) else {
                        return Err(format!("unterminated string in {expr}"));
                    };
                    i += 1;
                    value.push(e);
                } else {
                    value.push(d);
                }
            }
            tokens.push(Token::Str(value));
        } else if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '_') {
                i += 1;
            }
            tokens.push(Token::Number);
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                while i < chars.len() && ident_char(chars[i]) {
                    i += 1;
                }
            }
            tokens.push(Token::Var);
        } else if ident_start(c) {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            tokens.push(Token::Ident(chars[start..i].iter().collect()));
        } else {
            let rest: String = chars[i..chars.len().min(i + 2)].iter().collect();
            let punct = PUNCTS
                .iter()
                .find(|p| rest.starts_with(**p))
                .ok_or_else(|| format!("unexpected {c:?} in {expr}"))?;
            tokens.push(Token::Punct(punct));
            i += punct.len();
        }
    }
    Ok(tokens)
}

/// Aggregation operators: followed by `by`/`without` or `(`, never a metric.
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords and binary operators spelt as words.
const KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
];
/// Keywords whose parenthesised list holds label names.
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

/// One label matcher: `label op "value"`.
#[derive(Clone, Debug, PartialEq)]
struct Matcher {
    label: String,
    op: &'static str,
    value: String,
}

/// A vector selector: a metric name and its matchers.
#[derive(Clone, Debug, PartialEq)]
struct Selector {
    metric: String,
    matchers: Vec<Matcher>,
}

/// What an expression refers to: its selectors and the labels it groups or matches on.
#[derive(Debug, Default, PartialEq)]
struct Refs {
    selectors: Vec<Selector>,
    grouping: BTreeSet<String>,
}

impl Refs {
    fn metrics(&self) -> BTreeSet<&str> {
        self.selectors.iter().map(|s| s.metric.as_str()).collect()
    }
}

/// The selectors of a PromQL expression: identifiers that are not functions (followed by
/// `(`), aggregations, keywords, label names (in `{...}` or a `by (...)`-style list),
/// durations (in `[...]` or after `offset`), numbers or Grafana variables. A selector without
/// a name (`{__name__="x"}`) takes its name from the `__name__` matcher.
fn refs(expr: &str) -> Result<Refs, String> {
    let tokens = lex(expr)?;
    let mut refs = Refs::default();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Punct("[") => {
                while i < tokens.len() && tokens[i] != Token::Punct("]") {
                    i += 1;
                }
                i += 1;
            }
            Token::Punct("{") => {
                let (matchers, next) = matchers(&tokens, i + 1, expr)?;
                let name = matchers
                    .iter()
                    .find(|m| m.label == "__name__" && m.op == "=")
                    .map(|m| m.value.clone())
                    .ok_or_else(|| format!("a selector without a metric name in {expr}"))?;
                refs.selectors.push(Selector { metric: name, matchers });
                i = next;
            }
            Token::Ident(word) => {
                let called = tokens.get(i + 1) == Some(&Token::Punct("("));
                if LABEL_LISTS.contains(&word.as_str()) && called {
                    i += 2;
                    while i < tokens.len() && tokens[i] != Token::Punct(")") {
                        if let Token::Ident(label) = &tokens[i] {
                            refs.grouping.insert(label.clone());
                        }
                        i += 1;
                    }
                    i += 1;
                    continue;
                }
                let lower = word.to_ascii_lowercase();
                if called
                    || AGGREGATIONS.contains(&word.as_str())
                    || KEYWORDS.contains(&word.as_str())
                    || lower == "inf"
                    || lower == "nan"
                {
                    i += 1;
                    continue;
                }
                let mut selector = Selector {
                    metric: word.clone(),
                    matchers: Vec::new(),
                };
                i += 1;
                if tokens.get(i) == Some(&Token::Punct("{")) {
                    let (matchers, next) = matchers(&tokens, i + 1, expr)?;
                    selector.matchers = matchers;
                    i = next;
                }
                refs.selectors.push(selector);
            }
            _ => i += 1,
        }
    }
    Ok(refs)
}

/// The matchers from `tokens[start..]` up to the closing `}`, and the index after it.
fn matchers(tokens: &[Token], mut i: usize, expr: &str) -> Result<(Vec<Matcher>, usize), String> {
    let mut out = Vec::new();
    loop {
        match tokens.get(i) {
            Some(Token::Punct("}")) => return Ok((out, i + 1)),
            Some(Token::Punct(",")) => i += 1,
            Some(Token::Ident(label)) => {
                let op = match tokens.get(i + 1) {
                    Some(Token::Punct(op @ ("=" | "!=" | "=~" | "!~"))) => *op,
                    other => return Err(format!("matcher {label} without an operator ({other:?}) in {expr}")),
                };
                let value = match tokens.get(i + 2) {
                    Some(Token::Str(v)) => v.clone(),
                    other => return Err(format!("matcher {label} without a string value ({other:?}) in {expr}")),
                };
                out.push(Matcher {
                    label: label.clone(),
                    op,
                    value,
                });
                i += 3;
            }
            other => return Err(format!("unexpected {other:?} in a label matcher of {expr}")),
        }
    }
}

// ---- what tollgate exports ------------------------------------------------------------------

/// Series names, each with its labels and the values seen for each label.
#[derive(Debug, Default)]
struct Exported {
    series: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

impl Exported {
    /// Adds every sample line of a text-format scrape (checked by [`Scrape::parse`] first).
    fn add_scrape(&mut self, text: &str) {
        Scrape::parse(text);
        for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let end = line.find(['{', ' ']).expect("a sample line has a value");
            let labels = self.series.entry(line[..end].to_owned()).or_default();
            let Some(rest) = line[end..].strip_prefix('{') else {
                continue;
            };
            let tokens = lex(rest.rsplit_once('}').expect("labels end with }").0).expect("labels lex");
            for pair in tokens.split(|t| *t == Token::Punct(",")).filter(|p| !p.is_empty()) {
                match pair {
                    [Token::Ident(k), Token::Punct("="), Token::Str(v)] => {
                        labels.entry(k.clone()).or_default().insert(v.clone());
                    }
                    other => panic!("unexpected label pair {other:?} in {line}"),
                }
            }
        }
    }

    /// Why `refs` does not fit what tollgate exports, one line per problem (none: it fits).
    fn problems(&self, refs: &Refs) -> Vec<String> {
        let mut problems = Vec::new();
        let mut labels_in_use: BTreeSet<&str> = TARGET_LABELS.iter().copied().collect();
        for s in &refs.selectors {
            if PROMETHEUS_SERIES.contains(&s.metric.as_str()) {
                continue;
            }
            let Some(labels) = self.series.get(&s.metric) else {
                problems.push(format!("metric {} is not exported by tollgate", s.metric));
                continue;
            };
            labels_in_use.extend(labels.keys().map(String::as_str));
            for m in &s.matchers {
                if m.label == "__name__" || TARGET_LABELS.contains(&m.label.as_str()) || m.value.contains('$') {
                    continue;
                }
                let Some(values) = labels.get(&m.label) else {
                    problems.push(format!("{} has no label {}", s.metric, m.label));
                    continue;
                };
                // A regex of plain alternatives (`ok|over_limit`) is checked value by value.
                let wanted: Vec<&str> = match m.op {
                    "=" | "!=" => vec![m.value.as_str()],
                    _ if m.value.chars().all(|c| c.is_ascii_alphanumeric() || "_|.+".contains(c)) => {
                        m.value.split('|').collect()
                    }
                    _ => Vec::new(),
                };
                for v in wanted {
                    if !values.contains(v) {
                        problems.push(format!(
                            "{}{{{}{}\"{v}\"}}: tollgate exports no such value (it has {values:?})",
                            s.metric, m.label, m.op
                        ));
                    }
                }
            }
        }
        for label in &refs.grouping {
            if !labels_in_use.contains(label.as_str()) {
                problems.push(format!("grouping label {label} is on none of the metrics used"));
            }
        }
        problems
    }

    /// The metric families: names without the histogram suffixes, and without Prometheus's
    /// own series.
    fn families(&self) -> BTreeSet<String> {
        let histograms: BTreeSet<&str> = self
            .series
            .keys()
            .filter_map(|n| n.strip_suffix("_bucket"))
            .filter(|base| self.series.contains_key(&format!("{base}_count")))
            .collect();
        self.series
            .keys()
            .map(|n| {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| n.strip_suffix(s).filter(|b| histograms.contains(b)))
                    .unwrap_or(n)
                    .to_owned()
            })
            .collect()
    }
}

// ---- the expressions of the kit -------------------------------------------------------------

fn dashboard() -> Json {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every panel, rows' nested panels included.
fn all_panels(dashboard: &Json) -> Vec<&Json> {
    fn walk<'a>(panels: &'a Json, out: &mut Vec<&'a Json>) {
        for p in panels.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// `(where, expression)` for every PromQL expression of the dashboard: panel targets, query
/// variables (the series argument of `label_values`) and annotations.
fn dashboard_expressions(dashboard: &Json) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in all_panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            out.push((
                format!(
                    "panel {} \"{}\" target {}",
                    p["id"],
                    p["title"].as_str().unwrap_or(""),
                    t["refId"]
                ),
                expr.to_owned(),
            ));
        }
    }
    for v in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let query = v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or_default();
        let inner = query
            .trim()
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: not a label_values query: {query}", v["name"]));
        if let Some((series, _label)) = inner.rsplit_once(',') {
            out.push((format!("variable {}", v["name"]), series.to_owned()));
        }
    }
    for a in dashboard["annotations"]["list"].as_array().into_iter().flatten() {
        if let Some(expr) = a["expr"].as_str() {
            out.push((format!("annotation {}", a["name"]), expr.to_owned()));
        }
    }
    out
}

fn alerts() -> serde_yaml::Value {
    serde_yaml::from_str(&read(ALERTS)).unwrap_or_else(|e| panic!("{ALERTS} is not YAML: {e}"))
}

/// Every rule of a rule-groups document.
fn rules(groups: &serde_yaml::Value) -> Vec<&serde_yaml::Value> {
    groups["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("a group has rules"))
        .collect()
}

fn alert_expressions() -> Vec<(String, String)> {
    let alerts = alerts();
    rules(&alerts)
        .into_iter()
        .map(|r| {
            (
                format!("alert {}", r["alert"].as_str().expect("an alerting rule")),
                r["expr"].as_str().expect("an expr").to_owned(),
            )
        })
        .collect()
}

/// `(where, expression)` for every rule in the `yaml prometheus-rules` blocks of the monitoring
/// page, whose queries should fit tollgate's metrics as well as the kit's.
fn doc_rule_expressions() -> Vec<(String, String)> {
    let text = read(DOC);
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        if line.trim() != "```yaml prometheus-rules" {
            continue;
        }
        let block: Vec<&str> = lines
            .by_ref()
            .map(|(_, l)| l)
            .take_while(|l| l.trim() != "```")
            .collect();
        let groups: serde_yaml::Value =
            serde_yaml::from_str(&block.join("\n")).unwrap_or_else(|e| panic!("{DOC}:{}: not YAML: {e}", n + 1));
        for r in rules(&groups) {
            let name = r["record"].as_str().or(r["alert"].as_str()).unwrap_or("?");
            out.push((
                format!("{DOC}:{} rule {name}", n + 1),
                r["expr"].as_str().expect("an expr").to_owned(),
            ));
        }
    }
    out
}

/// The YAML blocks of the monitoring page fenced as ```yaml `kind` (one value per document).
fn doc_blocks(kind: &str) -> Vec<serde_yaml::Value> {
    use serde::Deserialize;
    let text = read(DOC);
    let fence = format!("```yaml {kind}");
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != fence {
            continue;
        }
        let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        let block = block.join("\n");
        for doc in serde_yaml::Deserializer::from_str(&block) {
            out.push(serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{DOC}: not YAML: {e}")));
        }
    }
    out
}

/// The namespace and the Services of `deploy/kubernetes/` (its kustomization's resource files).
fn kubernetes_services() -> (String, Vec<serde_yaml::Value>) {
    use serde::Deserialize;
    let k: serde_yaml::Value = serde_yaml::from_str(&read("deploy/kubernetes/kustomization.yaml")).unwrap();
    let namespace = k["namespace"]
        .as_str()
        .expect("the kustomization's namespace")
        .to_owned();
    let mut services = Vec::new();
    for file in k["resources"].as_sequence().unwrap() {
        let text = read(&format!("deploy/kubernetes/{}", file.as_str().unwrap()));
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let doc = serde_yaml::Value::deserialize(doc).unwrap();
            if doc["kind"] == "Service" {
                services.push(doc);
            }
        }
    }
    (namespace, services)
}

/// The Kubernetes names the monitoring page uses exist in `deploy/kubernetes/`: the
/// `dns_sd_configs` names are `<headless Service>.<namespace>.svc.cluster.local` with a port of
/// it, and the ServiceMonitor looks in that namespace, selects exactly one Service (so every pod
/// is scraped once) and scrapes a port of it by name.
#[test]
fn the_names_the_monitoring_page_uses_exist_in_the_manifests() {
    let (namespace, services) = kubernetes_services();
    let service = |name: &str| {
        services
            .iter()
            .find(|s| s["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{DOC} names the Service {name}, which deploy/kubernetes lacks"))
    };
    let ports = |svc: &serde_yaml::Value| -> Vec<(String, u64)> {
        svc["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|p| (p["name"].as_str().unwrap().to_owned(), p["port"].as_u64().unwrap()))
            .collect()
    };
    let mut dns_names = 0;
    for config in doc_blocks("prometheus-config") {
        for job in config["scrape_configs"].as_sequence().into_iter().flatten() {
            for sd in job["dns_sd_configs"].as_sequence().into_iter().flatten() {
                let port = sd["port"].as_u64().expect("a dns_sd port");
                for name in sd["names"].as_sequence().unwrap() {
                    let name = name.as_str().unwrap();
                    let parts: Vec<&str> = name.split('.').collect();
                    assert_eq!(
                        parts[1..],
                        [namespace.as_str(), "svc", "cluster", "local"],
                        "{DOC}: {name} is not a Service name of the namespace {namespace}"
                    );
                    let svc = service(parts[0]);
                    assert_eq!(
                        svc["spec"]["clusterIP"], "None",
                        "{name}: only a headless Service resolves to the pods"
                    );
                    assert!(ports(svc).iter().any(|(_, p)| *p == port), "{name}: no port {port}");
                    dns_names += 1;
                }
            }
        }
    }
    assert!(dns_names > 0, "{DOC}: the dns_sd example");

    let monitors: Vec<serde_yaml::Value> = doc_blocks("kubernetes")
        .into_iter()
        .filter(|d| d["kind"] == "ServiceMonitor")
        .collect();
    assert_eq!(monitors.len(), 1, "{DOC}: the ServiceMonitor example");
    let spec = &monitors[0]["spec"];
    let names: Vec<&str> = spec["namespaceSelector"]["matchNames"]
        .as_sequence()
        .expect("a namespaceSelector with matchNames")
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert_eq!(names, [namespace.as_str()]);
    let wanted = spec["selector"]["matchLabels"].as_mapping().expect("matchLabels");
    let selected: Vec<&serde_yaml::Value> = services
        .iter()
        .filter(|s| wanted.iter().all(|(k, v)| s["metadata"]["labels"].get(k) == Some(v)))
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "the ServiceMonitor selects {} Services",
        selected.len()
    );
    for endpoint in spec["endpoints"].as_sequence().unwrap() {
        let port = endpoint["port"].as_str().unwrap();
        assert!(
            ports(selected[0]).iter().any(|(n, _)| n == port),
            "the ServiceMonitor scrapes port {port}, which the Service lacks"
        );
    }
}

/// The labels a Grafana legend format interpolates (`{{domain}}/{{bucket}}`).
fn legend_labels(legend: &str) -> Vec<&str> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|part| part.split_once("}}"))
        .map(|(label, _)| label.trim())
        .collect()
}

// ---- the tollgates whose /metrics are the reference -----------------------------------------

const RULES: &str = r#"
domain: shop
buckets:
  per_user: {capacity: 5, refill: 5/1h}
descriptors:
  - key: user
    bucket: per_user
  - key: path
    value: /shadow
    name: shadowed
    token_bucket: {capacity: 1, refill: 1/1h}
    shadow_mode: true
"#;

async fn connect(tollgate: &Tollgate) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect")
}

async fn code(c: &mut RateLimitServiceClient<Channel>, req: RateLimitRequest) -> Code {
    let resp = c.should_rate_limit(req).await.expect("an answer").into_inner();
    Code::try_from(resp.overall_code).expect("a known code")
}

fn metrics_text(tollgate: &Tollgate) -> String {
    match support::http_get(tollgate.http_addr, "/metrics") {
        Some((200, body)) => body,
        other => panic!("GET /metrics: {other:?}"),
    }
}

/// The series of a tollgate on Redis with the memory fallback after every decision code, and
/// of one answering `failure_mode: allow` for a Redis that is not there; `None` without Redis.
async fn exported(test: &str) -> Option<Exported> {
    let url = support::redis::shared_redis(test)?;
    let prefix = support::redis::unique_prefix(test);
    let redis = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shop.yaml", RULES)
            .settings(&format!(
                "backend: redis\nredis: {{urls: [{}], key_prefix: {}, failure_mode: fallback, fallback: memory}}",
                support::yaml_str(&url),
                support::yaml_str(&prefix)
            ))
            .start()
    });
    let mut c = connect(&redis).await;
    // Capacity 5: ok, near_limit and over_limit decisions; a refund; shadow mode (near_limit,
    // then shadow_over_limit); a malformed request, an invalid one and an unknown domain.
    for _ in 0..7 {
        code(&mut c, request("shop", &[("user", "alice")], 0)).await;
    }
    let mut refund = descriptor(&[("user", "alice")]);
    refund.is_negative_hits = true;
    refund.hits_addend = Some(UInt64Value { value: 1 });
    let refund = RateLimitRequest {
        domain: "shop".into(),
        descriptors: vec![refund],
        hits_addend: 0,
    };
    assert_eq!(code(&mut c, refund).await, Code::Ok);
    for _ in 0..3 {
        assert_eq!(code(&mut c, request("shop", &[("path", "/shadow")], 0)).await, Code::Ok);
    }
    // A malformed part is decided (an empty domain is an unknown one); only a message that is
    // not a RateLimitRequest at all is INVALID_ARGUMENT.
    assert_eq!(code(&mut c, request("", &[("user", "x")], 0)).await, Code::Ok);
    let invalid = support::raw_call(
        &format!("http://{}", redis.grpc_addr),
        support::NotARequest { domain: 7 },
    )
    .await
    .unwrap_err();
    assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
    assert_eq!(code(&mut c, request("nowhere", &[("user", "bob")], 0)).await, Code::Ok);

    // A "Redis" that accepts connections and never answers: every call fails and
    // failure_mode: allow answers. Held for the whole test, so no other test's server can get
    // its port.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let absent = format!("redis://{}", silent.local_addr().unwrap());
    let failing = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shop.yaml", RULES)
            .settings(&format!(
                "backend: redis\nredis: {{urls: [{}], failure_mode: allow, unreachable_at_start: not_ready, \
                 connect_timeout_ms: 200}}",
                support::yaml_str(&absent)
            ))
            .start()
    });
    let mut f = connect(&failing).await;
    assert_eq!(code(&mut f, request("shop", &[("user", "carol")], 0)).await, Code::Ok);

    // A Redis Cluster, for the per-master series (tollgate_redis_cluster_*).
    let cluster = block_in_place(support::redis::RedisCluster::start);
    let urls: Vec<String> = cluster.urls().iter().map(|u| support::yaml_str(u)).collect();
    let on_cluster = block_in_place(|| {
        Tollgate::builder()
            .rules_file("shop.yaml", RULES)
            .settings(&format!(
                "backend: redis\nredis: {{urls: [{}], cluster: true, key_prefix: {}}}",
                urls.join(", "),
                support::yaml_str(&prefix)
            ))
            .start()
    });
    let mut k = connect(&on_cluster).await;
    assert_eq!(code(&mut k, request("shop", &[("user", "dora")], 0)).await, Code::Ok);

    let mut exported = Exported::default();
    exported.add_scrape(&block_in_place(|| metrics_text(&redis)));
    exported.add_scrape(&block_in_place(|| metrics_text(&failing)));
    exported.add_scrape(&block_in_place(|| metrics_text(&on_cluster)));
    // The mix above must have produced what the kit watches, or the check below means little.
    for name in [
        "tollgate_decisions_total",
        "tollgate_hits_total",
        "tollgate_backend_fallbacks_total",
        "tollgate_backend_failure_answers_total",
        "tollgate_memory_buckets",
        "tollgate_redis_cluster_node_up",
    ] {
        assert!(exported.series.contains_key(name), "no {name} in the scrapes");
    }
    let codes = &exported.series["tollgate_decisions_total"]["code"];
    for c in ["ok", "near_limit", "over_limit", "shadow_over_limit", "refund"] {
        assert!(codes.contains(c), "no decision with code {c}: {codes:?}");
    }
    Some(exported)
}

// ---- tests ----------------------------------------------------------------------------------

#[test]
fn the_promql_reader_finds_metrics_and_nothing_else() {
    let r = refs(
        r#"histogram_quantile(0.99, sum by (job, le) (rate(tollgate_request_duration_seconds_bucket{instance=~"$instance", le!="0.5"}[$__rate_interval] offset 5m)))
           / on (instance) group_left (version) max without (code) (tollgate_build_info) > bool 1e-9
           or vector(0) unless up{job=~".*tollgate.*"} and time() - x:recorded:rate5m"#,
    )
    .unwrap();
    assert_eq!(
        r.metrics(),
        BTreeSet::from([
            "tollgate_request_duration_seconds_bucket",
            "tollgate_build_info",
            "up",
            "x:recorded:rate5m"
        ])
    );
    assert_eq!(
        r.grouping,
        BTreeSet::from(["job", "le", "instance", "version", "code"].map(String::from))
    );
    assert_eq!(
        r.selectors[0].matchers,
        vec![
            Matcher {
                label: "instance".into(),
                op: "=~",
                value: "$instance".into()
            },
            Matcher {
                label: "le".into(),
                op: "!=",
                value: "0.5".into()
            }
        ]
    );
    // A name only in a matcher, and strings that look like selectors.
    let r = refs(r#"count({__name__="tollgate_memory_buckets"}) + label_replace(up, "a", "b{c}", "d", "e")"#).unwrap();
    assert_eq!(r.metrics(), BTreeSet::from(["tollgate_memory_buckets", "up"]));
    assert!(refs("sum(rate(x{code=~}[5m]))").is_err());
}

#[test]
fn a_query_naming_what_tollgate_does_not_export_is_reported() {
    let mut exported = Exported::default();
    exported.add_scrape(
        "# TYPE tollgate_requests_total counter\ntollgate_requests_total{code=\"ok\"} 1\n\
         tollgate_requests_total{code=\"over_limit\"} 1\n",
    );
    let fits = refs(r#"sum by (instance, code) (rate(tollgate_requests_total{code=~"ok|over_limit"}[5m]))"#).unwrap();
    assert_eq!(exported.problems(&fits), Vec::<String>::new());
    let wrong =
        refs(r#"sum by (backend) (rate(tollgate_request_total{code="ok"}[5m])) + tollgate_requests_total{code="denied", kind="x"}"#)
            .unwrap();
    assert_eq!(
        exported.problems(&wrong),
        vec![
            "metric tollgate_request_total is not exported by tollgate".to_owned(),
            r#"tollgate_requests_total{code="denied"}: tollgate exports no such value (it has {"ok", "over_limit"})"#
                .to_owned(),
            "tollgate_requests_total has no label kind".to_owned(),
            "grouping label backend is on none of the metrics used".to_owned(),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_of_the_dashboard_and_the_alerts_names_only_what_tollgate_exports() {
    let test = "every_query_of_the_dashboard_and_the_alerts_names_only_what_tollgate_exports";
    let Some(exported) = exported(test).await else { return };
    let dashboard = dashboard();
    let from_doc = doc_rule_expressions();
    assert!(!from_doc.is_empty(), "{DOC} has no prometheus-rules block");
    let expressions: Vec<_> = dashboard_expressions(&dashboard)
        .into_iter()
        .chain(alert_expressions())
        .chain(from_doc)
        .collect();
    assert!(expressions.len() > 50, "only {} expressions found", expressions.len());
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for (place, expr) in &expressions {
        match refs(expr) {
            Ok(r) if r.selectors.is_empty() => problems.push(format!("{place}: selects no series: {expr}")),
            Ok(r) => {
                used.extend(r.metrics().into_iter().map(str::to_owned));
                problems.extend(exported.problems(&r).into_iter().map(|p| format!("{place}: {p}")));
            }
            Err(e) => problems.push(format!("{place}: {e}")),
        }
    }
    assert!(
        problems.is_empty(),
        "queries that do not fit tollgate's /metrics:\n{}",
        problems.join("\n")
    );

    // And the other way round: every tollgate_* metric is on the dashboard.
    let on_dashboard: BTreeSet<String> = dashboard_expressions(&dashboard)
        .iter()
        .flat_map(|(_, e)| {
            refs(e)
                .unwrap()
                .metrics()
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let missing: Vec<_> = exported
        .families()
        .into_iter()
        .filter(|f| f.starts_with("tollgate_"))
        .filter(|f| {
            !["", "_bucket", "_sum", "_count"]
                .iter()
                .any(|s| on_dashboard.contains(&format!("{f}{s}")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "tollgate metrics no dashboard panel shows: {missing:?}"
    );
    assert!(used.contains("tollgate_backend_circuit_open"), "{used:?}");

    // A legend names labels the query's result has: those it groups by, else the series' own.
    let mut wrong_legends = Vec::new();
    for p in all_panels(&dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let legend = t["legendFormat"].as_str().unwrap_or_default();
            let r = refs(t["expr"].as_str().unwrap_or_default()).unwrap();
            let allowed: BTreeSet<&str> = if r.grouping.is_empty() {
                r.selectors
                    .iter()
                    .filter_map(|s| exported.series.get(&s.metric))
                    .flat_map(|labels| labels.keys().map(String::as_str))
                    .chain(TARGET_LABELS.iter().copied())
                    .collect()
            } else {
                r.grouping.iter().map(String::as_str).collect()
            };
            for label in legend_labels(legend) {
                if !allowed.contains(label) {
                    wrong_legends.push(format!(
                        "panel {} {}: legend {legend:?} names {label}",
                        p["id"], p["title"]
                    ));
                }
            }
        }
    }
    assert!(wrong_legends.is_empty(), "{}", wrong_legends.join("\n"));
}

#[test]
fn the_dashboard_has_the_expected_structure() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 39),
        "schemaVersion {}",
        d["schemaVersion"]
    );
    assert!(
        d["uid"].as_str().is_some_and(|u| !u.is_empty() && u.len() <= 40),
        "uid {}",
        d["uid"]
    );
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));

    let vars = d["templating"]["list"].as_array().expect("templating.list");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no template variable {name}"))
    };
    let ds = var("datasource");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    for (name, label) in [
        ("job", "job"),
        ("instance", "instance"),
        ("domain", "domain"),
        ("bucket", "bucket"),
    ] {
        let v = var(name);
        assert_eq!(v["type"], "query", "{name}");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "{name}");
        let query = v["query"]["query"].as_str().unwrap_or_default();
        assert!(
            query.starts_with("label_values(") && query.ends_with(&format!(", {label})")),
            "{name}: {query}"
        );
    }

    let panels = all_panels(&d);
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    let mut cells: HashMap<(u64, u64), u64> = HashMap::new();
    for p in &panels {
        let id = p["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("a panel without a numeric id: {}", p["title"]));
        assert!(ids.insert(id), "panel id {id} is used twice");
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "panel {id} has no title");
        let g = &p["gridPos"];
        let (x, y, w, h) = (g["x"].as_u64(), g["y"].as_u64(), g["w"].as_u64(), g["h"].as_u64());
        let (Some(x), Some(y), Some(w), Some(h)) = (x, y, w, h) else {
            panic!("panel {id} {title}: gridPos {g}")
        };
        assert!(w > 0 && h > 0 && x + w <= 24, "panel {id} {title}: gridPos {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                if let Some(other) = cells.insert((cx, cy), id) {
                    panic!("panels {other} and {id} overlap at ({cx}, {cy})");
                }
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(titles.insert(title), "two panels are titled {title}");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {id} {title}");
        assert!(
            p["description"].as_str().is_some_and(|s| s.len() > 20),
            "panel {id} {title}: no description"
        );
        let targets = p["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.unwrap_or_else(|| panic!("panel {id} {title} has no targets"));
        let mut refs_seen = BTreeSet::new();
        for t in targets {
            assert!(
                t["expr"].as_str().is_some_and(|e| !e.trim().is_empty()),
                "panel {id} {title}: {t}"
            );
            assert!(
                refs_seen.insert(t["refId"].as_str().expect("refId")),
                "panel {id}: refId twice"
            );
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {id} {title}");
        }
        if p["type"] == "timeseries" || p["type"] == "stat" {
            let unit = p["fieldConfig"]["defaults"]["unit"].as_str();
            assert!(unit.is_some_and(|u| !u.is_empty()), "panel {id} {title}: no unit");
        }
    }
    assert!(ids.len() > 30, "{} panels", ids.len());

    // What the kit promises to show, by the metric behind it.
    let exprs: Vec<String> = dashboard_expressions(&d).into_iter().map(|(_, e)| e).collect();
    let shows = |needle: &str| exprs.iter().any(|e| e.contains(needle));
    for needle in [
        "histogram_quantile(0.5, sum by (le) (rate(tollgate_request_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(tollgate_request_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (backend, le) (rate(tollgate_backend_call_duration_seconds_bucket",
        "sum by (backend, kind) (rate(tollgate_backend_errors_total",
        "code=\"shadow_over_limit\"",
        "code=\"refund\"",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    ] {
        assert!(shows(needle), "no dashboard query has {needle}");
    }
}

/// Each dashboard query, with Grafana's variables given values, parses as PromQL: `promtool`
/// checks them as recording rules.
#[test]
fn the_dashboard_queries_parse_as_promql() {
    let Some(promtool) = tool_or_skip("the_dashboard_queries_parse_as_promql", "promtool") else {
        return;
    };
    let substitute = |expr: &str| {
        let mut out = expr.to_owned();
        for (var, value) in [
            ("${__rate_interval}", "5m"),
            ("$__rate_interval", "5m"),
            ("$__interval", "1m"),
            ("$__range", "1h"),
            ("$job", ".*"),
            ("$instance", ".*"),
            ("$domain", ".*"),
            ("$bucket", ".*"),
        ] {
            out = out.replace(var, value);
        }
        assert!(!out.contains('$'), "a Grafana variable the test does not know: {expr}");
        out
    };
    let rules: Vec<serde_yaml::Value> = dashboard_expressions(&dashboard())
        .iter()
        .enumerate()
        .map(|(n, (_, expr))| {
            serde_yaml::to_value(BTreeMap::from([
                ("record", format!("dashboard:query_{n}")),
                ("expr", substitute(expr)),
            ]))
            .unwrap()
        })
        .collect();
    let doc = serde_yaml::to_string(&BTreeMap::from([(
        "groups",
        vec![BTreeMap::from([
            ("name", serde_yaml::Value::from("dashboard")),
            ("rules", rules.into()),
        ])],
    )]))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-queries.yaml");
    std::fs::write(&file, &doc).unwrap();
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool rejects a dashboard query:\n{}{}\n{doc}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_accepts_the_alerting_rules() {
    let Some(promtool) = tool_or_skip("promtool_accepts_the_alerting_rules", "promtool") else {
        return;
    };
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(repo_file(ALERTS))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool check rules {ALERTS}:\n{text}");
    let count = rules(&alerts()).len();
    assert!(text.contains(&format!("SUCCESS: {count} rules found")), "{text}");
}

#[test]
fn the_alerts_pass_their_promtool_unit_tests() {
    let Some(promtool) = tool_or_skip("the_alerts_pass_their_promtool_unit_tests", "promtool") else {
        return;
    };
    // promtool reads the rule files relative to the test file.
    let out = Command::new(promtool)
        .args(["test", "rules"])
        .arg(repo_file(ALERT_TESTS))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules {ALERT_TESTS}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every alert has a unit test where it fires and one where it does not, and each alert is
/// written for an operator: a `for:`, a severity, a summary and a description.
#[test]
fn every_alert_is_tested_firing_and_not_and_is_annotated() {
    let alerts = alerts();
    let tests: serde_yaml::Value = serde_yaml::from_str(&read(ALERT_TESTS)).unwrap();
    assert_eq!(tests["rule_files"][0], "alerts.yaml");
    let mut fired = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests["tests"].as_sequence().expect("tests") {
        for check in t["alert_rule_test"].as_sequence().expect("alert_rule_test") {
            let name = check["alertname"].as_str().expect("alertname").to_owned();
            match check["exp_alerts"].as_sequence() {
                Some(expected) if !expected.is_empty() => fired.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    let mut names = BTreeSet::new();
    for r in rules(&alerts) {
        let name = r["alert"].as_str().expect("only alerting rules");
        assert!(names.insert(name), "alert {name} twice");
        assert!(name.starts_with("Tollgate"), "{name}");
        assert!(fired.contains(name), "{name}: no unit test fires it");
        assert!(quiet.contains(name), "{name}: no unit test where it stays quiet");
        assert!(r["for"].as_str().is_some_and(|f| !f.is_empty()), "{name}: no for:");
        let severity = r["labels"]["severity"].as_str();
        assert!(
            severity.is_some_and(|s| ["critical", "warning", "info"].contains(&s)),
            "{name}: severity {severity:?}"
        );
        for annotation in ["summary", "description"] {
            let text = r["annotations"][annotation].as_str().unwrap_or_default();
            assert!(text.len() > 30, "{name}: {annotation} {text:?}");
        }
    }
    for required in [
        "TollgateBackendErrors",
        "TollgateBackendCircuitOpen",
        "TollgateRulesReloadFailing",
        "TollgateMemoryEvictingUnfullBuckets",
        "TollgateFallbackInUse",
        "TollgateFailureAnswers",
        "TollgateSlowDecisions",
        "TollgateInvalidRequests",
        "TollgateMalformedRequests",
        "TollgateTargetDown",
        "TollgateTargetMissing",
    ] {
        assert!(names.contains(required), "no alert {required}");
    }
}

#[test]
fn the_prometheus_rule_holds_the_groups_of_alerts_yaml() {
    let wrapper: serde_yaml::Value = serde_yaml::from_str(&read(PROMETHEUS_RULE)).unwrap();
    assert_eq!(wrapper["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(wrapper["kind"], "PrometheusRule");
    assert!(wrapper["metadata"]["name"].as_str().is_some_and(|n| !n.is_empty()));
    let groups = &alerts()["groups"];
    assert!(groups.as_sequence().is_some_and(|g| !g.is_empty()));
    assert!(
        &wrapper["spec"]["groups"] == groups,
        "{PROMETHEUS_RULE}'s spec.groups differ from {ALERTS}'s groups: regenerate it in deploy/monitoring/ \
         with\n  {{ sed -n '1,/^spec:/p' prometheusrule.yaml; sed -n '/^groups:/,$p' alerts.yaml | sed 's/^/  /'; }} > prometheusrule.new && mv prometheusrule.new prometheusrule.yaml"
    );
}
