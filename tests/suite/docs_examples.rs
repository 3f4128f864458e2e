//! The documentation cannot rot: every fenced YAML block in README.md, docs/*.md and
//! benches/README.md declares what it is (` ```yaml rules`, ` ```yaml settings`, ...) and is
//! loaded as that, every relative link points at a file that exists (and, for `#anchor`s into
//! Markdown, at a heading, by GitHub's slug rules), and every `--rules PATH` in a shell block
//! names a path that exists.
//!
//! Kinds (the info string after `yaml`):
//! - `rules`: a whole rules file, loaded with `tollgate::rules::load_rules`; it must compile
//!   and declare at least one descriptor. `rules-invalid`: a file the docs show being refused;
//!   it must fail to load.
//! - `settings`: a tollgate settings file: `Settings::load` and `validate()`.
//! - `envoy`: a whole Envoy bootstrap, `envoy --mode validate` (skipped without Envoy unless
//!   `CI=true`, see `support::envoy_or_skip`). `envoy-fragment`: a YAML mapping or sequence.
//! - `kubernetes`: `kubernetes-validate --strict`, whose warnings (a kind it has no schema for)
//!   fail too; the CRD kinds the docs use (prometheus-operator's ServiceMonitor and
//!   PrometheusRule, Istio's EnvoyFilter and Gateway, Envoy Gateway's BackendTrafficPolicy,
//!   Envoy AI Gateway's AIGatewayRoute), which it has no schema for, are checked here instead:
//!   apiVersion, `metadata.name`, the keys under `spec` against the fields of those kinds, the
//!   keys some mappings require, and the values of their enumerations (see `CRDS`). `prometheus-rules`: `promtool check rules`;
//!   `prometheus-config`: `promtool check config` (each skipped without the tool unless
//!   `CI=true`, see `support::tools::tool_or_skip`).
//! - `compose`: a mapping whose `services` is a mapping of service mappings, with every
//!   `depends_on` naming a service of the block.
//!
//! Every problem is reported at once, each as `file:line: what`.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};
use serde::Deserialize;
use support::tools::tool_or_skip;
use support::{envoy_or_skip, envoy_validate};
use tempfile::TempDir;

/// The YAML kinds a fence may declare (see the module documentation).
const KINDS: [&str; 9] = [
    "rules",
    "rules-invalid",
    "settings",
    "envoy",
    "envoy-fragment",
    "kubernetes",
    "prometheus-rules",
    "prometheus-config",
    "compose",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files checked, relative to the repository root.
fn markdown_files() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![PathBuf::from("README.md")];
    if root.join("benches/README.md").is_file() {
        files.push(PathBuf::from("benches/README.md"));
    }
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "md") && p.is_file())
                .map(|p| p.strip_prefix(&root).expect("under the repository").to_owned())
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    files.extend(docs);
    files
}

/// A fenced code block: its info string, its text, and the line of its opening fence.
#[derive(Debug)]
struct Block {
    line: usize,
    info: String,
    text: String,
}

/// A link or image target and the line it is on.
#[derive(Debug)]
struct Link {
    line: usize,
    target: String,
}

/// What one Markdown file holds that the checks need.
#[derive(Debug, Default)]
struct Page {
    blocks: Vec<Block>,
    links: Vec<Link>,
    /// Anchors of its headings, by GitHub's rules.
    anchors: BTreeSet<String>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].bytes().filter(|&b| b == b'\n').count() + 1
}

/// Parses Markdown as GitHub renders it (tables on: a `|` inside a cell is not a link's end).
fn parse_page(text: &str) -> Page {
    let mut page = Page::default();
    let mut block: Option<Block> = None;
    let mut heading: Option<String> = None;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let options = Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TASKLISTS;
    for (event, range) in Parser::new_ext(text, options).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(kind)) => {
                let info = match kind {
                    CodeBlockKind::Fenced(info) => info.to_string(),
                    CodeBlockKind::Indented => "(indented)".to_owned(),
                };
                block = Some(Block {
                    line: line_of(text, range.start),
                    info,
                    text: String::new(),
                });
            }
            Event::End(TagEnd::CodeBlock) => page.blocks.extend(block.take()),
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                let slug = github_slug(&heading.take().unwrap_or_default());
                // GitHub numbers repeated headings: `x`, `x-1`, `x-2`.
                let n = seen.entry(slug.clone()).or_insert(0);
                let anchor = if *n == 0 { slug.clone() } else { format!("{slug}-{n}") };
                *n += 1;
                page.anchors.insert(anchor);
            }
            Event::Start(Tag::Link { dest_url, .. }) | Event::Start(Tag::Image { dest_url, .. }) => {
                page.links.push(Link {
                    line: line_of(text, range.start),
                    target: dest_url.to_string(),
                });
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(b) = block.as_mut() {
                    b.text.push_str(&t);
                } else if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            _ => {}
        }
    }
    page
}

/// GitHub's heading anchor: lower case, every character that is not a letter, digit, space,
/// `-` or `_` dropped, spaces turned into `-`.
fn github_slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The external checkers, looked up once (each may be missing: then its blocks are skipped,
/// or the test fails under `CI=true`).
#[derive(Default)]
struct Tools {
    envoy: Option<Option<PathBuf>>,
    kubernetes_validate: Option<Option<PathBuf>>,
    promtool: Option<Option<PathBuf>>,
}

impl Tools {
    fn envoy(&mut self) -> Option<PathBuf> {
        self.envoy
            .get_or_insert_with(|| envoy_or_skip("docs_examples (yaml envoy)"))
            .clone()
    }

    fn kubernetes_validate(&mut self) -> Option<PathBuf> {
        self.kubernetes_validate
            .get_or_insert_with(|| tool_or_skip("docs_examples (yaml kubernetes)", "kubernetes-validate"))
            .clone()
    }

    fn promtool(&mut self) -> Option<PathBuf> {
        self.promtool
            .get_or_insert_with(|| tool_or_skip("docs_examples (yaml prometheus-*)", "promtool"))
            .clone()
    }
}

/// Runs `tool args.. file` and returns its output as the error when it exits non-zero.
fn run_checker(tool: &Path, args: &[&str], file: &Path) -> Result<(), String> {
    let out = Command::new(tool)
        .args(args)
        .arg(file)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} {}: {}{} ({})",
            tool.file_name().unwrap_or_default().to_string_lossy(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout).trim_end(),
            String::from_utf8_lossy(&out.stderr).trim_end(),
            out.status
        ))
    }
}

/// Checks one YAML block of kind `kind`: `Ok(true)` when it was checked, `Ok(false)` when its
/// checker is missing (skipped), `Err` with the reason when it does not load.
fn check_yaml(kind: &str, text: &str, dir: &Path, tools: &mut Tools) -> Result<bool, String> {
    // Each block gets a directory of its own: a rules block is loaded as the only file of one.
    let dir = tempfile::Builder::new()
        .prefix("block.")
        .tempdir_in(dir)
        .expect("temporary directory");
    let write = |name: &str| {
        let path = dir.path().join(name);
        fs::write(&path, text).expect("write the block");
        path
    };
    match kind {
        "rules" => {
            let file = write("rules.yaml");
            // The temporary file's name says nothing about the block; the caller gives its line.
            let set = tollgate::rules::load_rules(dir.path()).map_err(|e| {
                format!(
                    "rules do not load: {}",
                    e.to_string().replace(&*file.to_string_lossy(), "the block")
                )
            })?;
            let doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
            let domain = doc.get("domain").and_then(|d| d.as_str()).unwrap_or_default();
            let descriptors = doc
                .get("descriptors")
                .and_then(|d| d.as_sequence())
                .map_or(0, |s| s.len());
            if set.domain(domain).is_none() || descriptors == 0 {
                return Err("rules load but declare no descriptor (an example should limit something)".into());
            }
            Ok(true)
        }
        "rules-invalid" => {
            write("rules.yaml");
            match tollgate::rules::load_rules(dir.path()) {
                Ok(_) => Err("shown as refused, but these rules load".into()),
                Err(_) => Ok(true),
            }
        }
        "settings" => {
            let path = write("tollgate.yaml");
            let settings =
                tollgate::server::settings::Settings::load(Some(&path)).map_err(|e| format!("settings: {e}"))?;
            settings
                .validate()
                .map_err(|e| format!("settings do not validate: {e}"))?;
            Ok(true)
        }
        "envoy" => {
            let Some(envoy) = tools.envoy() else { return Ok(false) };
            let path = write("envoy.yaml");
            envoy_validate(&envoy, &path).map_err(|e| format!("envoy --mode validate: {e}"))?;
            Ok(true)
        }
        "envoy-fragment" => {
            let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
            if value.is_mapping() || value.is_sequence() {
                Ok(true)
            } else {
                Err("an Envoy fragment must be a YAML mapping or sequence".into())
            }
        }
        "kubernetes" => {
            let mut plain = Vec::new();
            for doc in serde_yaml::Deserializer::from_str(text) {
                let doc = serde_yaml::Value::deserialize(doc).map_err(|e| format!("not YAML: {e}"))?;
                if doc.is_null() {
                    continue;
                }
                let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
                if CRDS.iter().any(|crd| crd.kind == kind) {
                    check_crd(&doc)?;
                } else {
                    plain.push(serde_yaml::to_string(&doc).expect("YAML"));
                }
            }
            if plain.is_empty() {
                return Ok(true);
            }
            let Some(tool) = tools.kubernetes_validate() else {
                return Ok(false);
            };
            let path = dir.path().join("manifests.yaml");
            fs::write(&path, plain.join("---\n")).expect("write the block");
            // Without --quiet: a kind it has no schema for is only a warning (exit 0).
            let out = Command::new(&tool)
                .arg("--strict")
                .arg(&path)
                .output()
                .map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
            let report = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout).trim_end(),
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
            if !out.status.success() || report.contains("WARN") {
                return Err(format!("kubernetes-validate --strict: {report} ({})", out.status));
            }
            Ok(true)
        }
        "prometheus-rules" => {
            let Some(tool) = tools.promtool() else { return Ok(false) };
            let path = write("rules.yaml");
            run_checker(&tool, &["check", "rules"], &path)?;
            Ok(true)
        }
        "prometheus-config" => {
            let Some(tool) = tools.promtool() else { return Ok(false) };
            let path = write("prometheus.yml");
            run_checker(&tool, &["check", "config"], &path)?;
            Ok(true)
        }
        "compose" => check_compose(text).map(|()| true),
        other => Err(format!("unknown kind `{other}` (one of: {})", KINDS.join(", "))),
    }
}

/// A custom resource kind kubernetes-validate has no schema for, and what its documents may
/// hold: the API versions, and for each mapping (a dotted path from `spec`, `[]` for every item
/// of a list) the keys allowed there. The keys come from the kinds' published references
/// (prometheus-operator's API, Istio's networking API, the Go API types of Envoy Gateway and
/// Envoy AI Gateway); only mappings listed are checked, the fields the docs use and their
/// common neighbours.
struct Crd {
    kind: &'static str,
    api_versions: &'static [&'static str],
    fields: &'static [(&'static str, &'static [&'static str])],
    /// Mappings (dotted paths, as in `fields`) and the keys each must hold.
    required: &'static [(&'static str, &'static [&'static str])],
    /// Scalars (dotted paths) and the values their enumeration allows.
    values: &'static [(&'static str, &'static [&'static str])],
}

const LABEL_SELECTOR: &[&str] = &["matchLabels", "matchExpressions"];

/// A Gateway API policy's target reference (Envoy Gateway's `targetRef`, `targetRefs[]`).
const POLICY_TARGET: &[&str] = &["group", "kind", "name", "sectionName"];

/// Where Envoy Gateway takes a rate-limit cost from (`cost.request`, `cost.response`).
const COST: &[&str] = &["from", "number", "metadata"];

const CRDS: [Crd; 6] = [
    Crd {
        kind: "ServiceMonitor",
        api_versions: &["monitoring.coreos.com/v1"],
        fields: &[
            (
                "spec",
                &[
                    "selector",
                    "endpoints",
                    "namespaceSelector",
                    "jobLabel",
                    "targetLabels",
                    "podTargetLabels",
                    "sampleLimit",
                    "scrapeProtocols",
                ],
            ),
            ("spec.selector", LABEL_SELECTOR),
            ("spec.namespaceSelector", &["matchNames", "any"]),
            (
                "spec.endpoints[]",
                &[
                    "port",
                    "targetPort",
                    "path",
                    "scheme",
                    "interval",
                    "scrapeTimeout",
                    "honorLabels",
                    "honorTimestamps",
                    "params",
                    "relabelings",
                    "metricRelabelings",
                    "tlsConfig",
                    "bearerTokenSecret",
                    "authorization",
                    "basicAuth",
                ],
            ),
        ],
        required: &[],
        values: &[],
    },
    Crd {
        kind: "PrometheusRule",
        api_versions: &["monitoring.coreos.com/v1"],
        fields: &[
            ("spec", &["groups"]),
            (
                "spec.groups[]",
                &["name", "interval", "rules", "limit", "partial_response_strategy"],
            ),
            (
                "spec.groups[].rules[]",
                &[
                    "alert",
                    "record",
                    "expr",
                    "for",
                    "keep_firing_for",
                    "labels",
                    "annotations",
                ],
            ),
        ],
        required: &[],
        values: &[],
    },
    Crd {
        kind: "EnvoyFilter",
        api_versions: &["networking.istio.io/v1alpha3"],
        fields: &[
            ("spec", &["workloadSelector", "targetRefs", "configPatches", "priority"]),
            ("spec.workloadSelector", &["labels"]),
            ("spec.configPatches[]", &["applyTo", "match", "patch"]),
            (
                "spec.configPatches[].match",
                &["context", "proxy", "listener", "routeConfiguration", "cluster"],
            ),
            ("spec.configPatches[].patch", &["operation", "value", "filterClass"]),
        ],
        required: &[],
        values: &[],
    },
    Crd {
        kind: "Gateway",
        api_versions: &[
            "networking.istio.io/v1",
            "networking.istio.io/v1beta1",
            "networking.istio.io/v1alpha3",
        ],
        fields: &[
            ("spec", &["selector", "servers"]),
            (
                "spec.servers[]",
                &["port", "hosts", "tls", "bind", "defaultEndpoint", "name"],
            ),
            ("spec.servers[].port", &["number", "name", "protocol", "targetPort"]),
        ],
        required: &[],
        values: &[],
    },
    Crd {
        kind: "BackendTrafficPolicy",
        api_versions: &["gateway.envoyproxy.io/v1alpha1"],
        fields: &[
            (
                "spec",
                &[
                    "targetRef",
                    "targetRefs",
                    "targetSelectors",
                    "mergeType",
                    "rateLimit",
                    "bandwidthLimit",
                    "faultInjection",
                    "admissionControl",
                    "useClientProtocol",
                    "compression",
                    "compressor",
                    "responseOverride",
                    "httpUpgrade",
                    "requestBuffer",
                    "telemetry",
                    "routingType",
                    "tracing",
                    "metrics",
                    "routeStatName",
                    "loadBalancer",
                    "retry",
                    "proxyProtocol",
                    "tcpKeepalive",
                    "healthCheck",
                    "circuitBreaker",
                    "timeout",
                    "connection",
                    "dns",
                    "http2",
                ],
            ),
            ("spec.targetRef", POLICY_TARGET),
            ("spec.targetRefs[]", POLICY_TARGET),
            ("spec.rateLimit", &["type", "global", "local"]),
            ("spec.rateLimit.global", &["rules"]),
            (
                "spec.rateLimit.global.rules[]",
                &[
                    "clientSelectors",
                    "limit",
                    "cost",
                    "shared",
                    "shadowMode",
                    "xRateLimitHeaders",
                ],
            ),
            (
                "spec.rateLimit.global.rules[].clientSelectors[]",
                &["headers", "methods", "path", "sourceCIDR", "queryParams"],
            ),
            (
                "spec.rateLimit.global.rules[].clientSelectors[].headers[]",
                &["type", "name", "value", "invert"],
            ),
            (
                "spec.rateLimit.global.rules[].limit",
                &["requests", "unit", "fromMetadata"],
            ),
            ("spec.rateLimit.global.rules[].cost", &["request", "response"]),
            ("spec.rateLimit.global.rules[].cost.request", COST),
            ("spec.rateLimit.global.rules[].cost.response", COST),
            (
                "spec.rateLimit.global.rules[].cost.request.metadata",
                &["namespace", "key"],
            ),
            (
                "spec.rateLimit.global.rules[].cost.response.metadata",
                &["namespace", "key"],
            ),
        ],
        required: &[
            ("spec.targetRef", &["group", "kind", "name"]),
            ("spec.targetRefs[]", &["group", "kind", "name"]),
            ("spec.rateLimit.global", &["rules"]),
            ("spec.rateLimit.global.rules[]", &["limit"]),
            ("spec.rateLimit.global.rules[].clientSelectors[].headers[]", &["name"]),
            ("spec.rateLimit.global.rules[].limit", &["requests", "unit"]),
            ("spec.rateLimit.global.rules[].cost.request", &["from"]),
            ("spec.rateLimit.global.rules[].cost.response", &["from"]),
            (
                "spec.rateLimit.global.rules[].cost.request.metadata",
                &["namespace", "key"],
            ),
            (
                "spec.rateLimit.global.rules[].cost.response.metadata",
                &["namespace", "key"],
            ),
        ],
        values: &[
            ("spec.rateLimit.type", &["Global", "Local"]),
            (
                "spec.rateLimit.global.rules[].limit.unit",
                &["Second", "Minute", "Hour", "Day", "Week", "Month", "Year"],
            ),
            (
                "spec.rateLimit.global.rules[].clientSelectors[].headers[].type",
                &["Exact", "RegularExpression", "Distinct"],
            ),
            (
                "spec.rateLimit.global.rules[].cost.request.from",
                &["Number", "Metadata"],
            ),
            (
                "spec.rateLimit.global.rules[].cost.response.from",
                &["Number", "Metadata"],
            ),
        ],
    },
    Crd {
        kind: "AIGatewayRoute",
        api_versions: &["aigateway.envoyproxy.io/v1beta1"],
        fields: &[
            ("spec", &["parentRefs", "hostnames", "rules", "llmRequestCosts"]),
            (
                "spec.parentRefs[]",
                &["group", "kind", "namespace", "name", "sectionName", "port"],
            ),
            (
                "spec.rules[]",
                &[
                    "name",
                    "backendRefs",
                    "matches",
                    "timeouts",
                    "streamIdleTimeout",
                    "modelsOwnedBy",
                    "modelsCreatedAt",
                ],
            ),
            (
                "spec.rules[].backendRefs[]",
                &[
                    "name",
                    "namespace",
                    "group",
                    "kind",
                    "modelNameOverride",
                    "headerMutation",
                    "bodyMutation",
                    "weight",
                    "priority",
                ],
            ),
            ("spec.rules[].matches[]", &["headers"]),
            ("spec.rules[].matches[].headers[]", &["type", "name", "value"]),
            ("spec.llmRequestCosts[]", &["metadataKey", "type", "cel"]),
        ],
        required: &[
            ("spec", &["rules"]),
            ("spec.parentRefs[]", &["name"]),
            ("spec.rules[].backendRefs[]", &["name"]),
            ("spec.rules[].matches[].headers[]", &["name", "value"]),
            ("spec.llmRequestCosts[]", &["metadataKey", "type"]),
        ],
        values: &[
            ("spec.rules[].matches[].headers[].type", &["Exact", "RegularExpression"]),
            (
                "spec.llmRequestCosts[].type",
                &[
                    "OutputToken",
                    "InputToken",
                    "CachedInputToken",
                    "CacheCreationInputToken",
                    "TotalToken",
                    "ReasoningToken",
                    "CEL",
                ],
            ),
        ],
    },
];

/// The values at dotted `path` of `value` (`name[]` steps into every item of the list `name`).
fn values_at<'a>(value: &'a serde_yaml::Value, path: &str) -> Vec<&'a serde_yaml::Value> {
    let mut current = vec![value];
    for step in path.split('.') {
        let (key, each) = match step.strip_suffix("[]") {
            Some(key) => (key, true),
            None => (step, false),
        };
        current = current
            .into_iter()
            .filter_map(|v| v.get(key))
            .flat_map(|v| match (each, v.as_sequence()) {
                (true, Some(items)) => items.iter().collect::<Vec<_>>(),
                (true, None) => Vec::new(),
                (false, _) => vec![v],
            })
            .collect();
    }
    current
}

/// Checks a document of a kind in `CRDS`: its apiVersion, a `metadata.name`, only known keys at
/// the top and in `metadata`, a `spec`, the keys of each listed mapping under it (only those
/// allowed, and those required), and the values of the listed enumerations.
fn check_crd(doc: &serde_yaml::Value) -> Result<(), String> {
    let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
    let crd = CRDS.iter().find(|c| c.kind == kind).expect("a CRD kind");
    let keys_of = |v: &serde_yaml::Value, at: &str| -> Result<Vec<String>, String> {
        let map = v.as_mapping().ok_or_else(|| format!("{kind}: {at} is not a mapping"))?;
        Ok(map.keys().map(|k| k.as_str().unwrap_or_default().to_owned()).collect())
    };
    let only = |v: &serde_yaml::Value, at: &str, allowed: &[&str]| -> Result<(), String> {
        for key in keys_of(v, at)? {
            if !allowed.contains(&key.as_str()) {
                return Err(format!(
                    "{kind}: unknown field `{key}` in {at} (known: {})",
                    allowed.join(", ")
                ));
            }
        }
        Ok(())
    };
    only(doc, "the document", &["apiVersion", "kind", "metadata", "spec"])?;
    let version = doc.get("apiVersion").and_then(|v| v.as_str()).unwrap_or_default();
    if !crd.api_versions.contains(&version) {
        return Err(format!(
            "{kind}: apiVersion `{version}` (one of: {})",
            crd.api_versions.join(", ")
        ));
    }
    let metadata = doc.get("metadata").ok_or_else(|| format!("{kind}: no metadata"))?;
    only(metadata, "metadata", &["name", "namespace", "labels", "annotations"])?;
    if metadata.get("name").and_then(|n| n.as_str()).is_none_or(str::is_empty) {
        return Err(format!("{kind}: no metadata.name"));
    }
    if doc.get("spec").is_none() {
        return Err(format!("{kind}: no spec"));
    }
    for (path, allowed) in crd.fields {
        for v in values_at(doc, path) {
            only(v, path, allowed)?;
        }
    }
    for (path, needed) in crd.required {
        for v in values_at(doc, path) {
            let keys = keys_of(v, path)?;
            if let Some(missing) = needed.iter().find(|k| !keys.iter().any(|key| key == *k)) {
                return Err(format!("{kind}: {path} has no `{missing}`"));
            }
        }
    }
    for (path, allowed) in crd.values {
        for v in values_at(doc, path) {
            let value = v.as_str().unwrap_or_default();
            if !allowed.contains(&value) {
                return Err(format!(
                    "{kind}: {path} is `{}` (one of: {})",
                    serde_yaml::to_string(v).unwrap_or_default().trim_end(),
                    allowed.join(", ")
                ));
            }
        }
    }
    Ok(())
}

/// A compose file, or a fragment of one: `services` a mapping of mappings, every `depends_on`
/// (list or mapping form) naming a service of the same block.
fn check_compose(text: &str) -> Result<(), String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    let services = doc
        .get("services")
        .and_then(|s| s.as_mapping())
        .ok_or("a compose block needs a `services:` mapping")?;
    if services.is_empty() {
        return Err("`services:` is empty".into());
    }
    let names: BTreeSet<&str> = services.keys().filter_map(|k| k.as_str()).collect();
    for (name, service) in services {
        let name = name.as_str().unwrap_or("?");
        let service = service
            .as_mapping()
            .ok_or(format!("service `{name}` is not a mapping"))?;
        let deps: Vec<&str> = match service.get("depends_on") {
            None => Vec::new(),
            Some(serde_yaml::Value::Sequence(list)) => list.iter().filter_map(|v| v.as_str()).collect(),
            Some(serde_yaml::Value::Mapping(map)) => map.keys().filter_map(|v| v.as_str()).collect(),
            Some(_) => return Err(format!("service `{name}`: depends_on is neither a list nor a mapping")),
        };
        if let Some(missing) = deps.iter().find(|d| !names.contains(**d)) {
            return Err(format!(
                "service `{name}` depends on `{missing}`, which the block does not define"
            ));
        }
    }
    Ok(())
}

/// Problems of every YAML block of `page` (in `file`); `counts` gains the blocks checked and
/// skipped, by kind.
fn check_blocks(
    file: &Path,
    page: &Page,
    tmp: &Path,
    tools: &mut Tools,
    counts: &mut BTreeMap<String, usize>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for block in &page.blocks {
        let mut words = block.info.split_whitespace();
        let lang = words.next().unwrap_or_default();
        if !lang.eq_ignore_ascii_case("yaml") && !lang.eq_ignore_ascii_case("yml") {
            continue;
        }
        let at = format!("{}:{}", file.display(), block.line);
        let Some(kind) = words.next() else {
            problems.push(format!(
                "{at}: a plain ```yaml fence; add its kind: ```yaml <{}>",
                KINDS.join("|")
            ));
            continue;
        };
        match check_yaml(kind, &block.text, tmp, tools) {
            Ok(true) => *counts.entry(kind.to_owned()).or_default() += 1,
            Ok(false) => *counts.entry(format!("{kind} (skipped)")).or_default() += 1,
            Err(reason) => problems.push(format!("{at}: ```yaml {kind}: {reason}")),
        }
    }
    problems
}

/// Problems of every relative link of `page` (in `file`); `pages` holds every checked page,
/// for anchors.
fn check_links(file: &Path, page: &Page, pages: &BTreeMap<PathBuf, Page>, root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for link in &page.links {
        let target = link.target.as_str();
        let external = target.contains("://") || target.starts_with("mailto:");
        if external || target.is_empty() {
            continue;
        }
        let at = format!("{}:{}", file.display(), link.line);
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target, None),
        };
        let resolved = if path.is_empty() {
            file.to_owned()
        } else if let Some(from_root) = path.strip_prefix('/') {
            PathBuf::from(from_root)
        } else {
            normalize(&file.parent().unwrap_or(Path::new("")).join(path))
        };
        if !root.join(&resolved).exists() {
            problems.push(format!("{at}: link `{target}`: {} does not exist", resolved.display()));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if resolved.extension().is_none_or(|x| x != "md") {
            continue;
        }
        let anchors = match pages.get(&resolved) {
            Some(p) => p.anchors.clone(),
            None => parse_page(&fs::read_to_string(root.join(&resolved)).unwrap_or_default()).anchors,
        };
        if !anchors.contains(anchor) {
            problems.push(format!(
                "{at}: link `{target}`: {} has no heading with anchor `#{anchor}`",
                resolved.display()
            ));
        }
    }
    problems
}

/// `a/b/../c` as `a/c`, without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Problems of shell blocks: a `--rules X` (or `--rules=X`) whose `X` is neither in the
/// repository nor made by the same block (`mkdir`, a redirection). Upper-case words (`PATH`)
/// and variables are placeholders.
fn check_shell(file: &Path, page: &Page, root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for block in &page.blocks {
        let lang = block.info.split_whitespace().next().unwrap_or_default();
        if !["sh", "bash", "shell", "console"].contains(&lang) {
            continue;
        }
        for (n, line) in block.text.lines().enumerate() {
            let code = line.split(" #").next().unwrap_or_default();
            let words: Vec<&str> = code.split_whitespace().collect();
            for (i, word) in words.iter().enumerate() {
                let arg = match word.strip_prefix("--rules") {
                    Some("") => words.get(i + 1).copied(),
                    Some(rest) => rest.strip_prefix('='),
                    None => None,
                };
                let Some(arg) = arg else { continue };
                let arg = arg.trim_matches(|c| c == '"' || c == '\'');
                let placeholder = arg.contains('$') || arg.chars().all(|c| c.is_ascii_uppercase() || c == '_');
                let trimmed = arg.trim_end_matches('/');
                let made_here = block.text.contains(&format!("mkdir -p {trimmed}"))
                    || block.text.contains(&format!("mkdir {trimmed}"))
                    || block.text.contains(&format!("> {trimmed}"));
                if !placeholder && !made_here && !root.join(arg).exists() {
                    problems.push(format!(
                        "{}:{}: `--rules {arg}`: no such path in the repository",
                        file.display(),
                        block.line + 1 + n
                    ));
                }
            }
        }
    }
    problems
}

/// Every check over every page under `root`, the counts of YAML blocks by kind, and the
/// problems.
fn check_all(root: &Path, files: &[PathBuf]) -> (BTreeMap<String, usize>, Vec<String>) {
    let pages: BTreeMap<PathBuf, Page> = files
        .iter()
        .map(|f| {
            let text = fs::read_to_string(root.join(f)).unwrap_or_else(|e| panic!("read {}: {e}", f.display()));
            (f.clone(), parse_page(&text))
        })
        .collect();
    let tmp = TempDir::new().expect("temporary directory");
    let mut tools = Tools::default();
    let mut counts = BTreeMap::new();
    let mut problems = Vec::new();
    for (file, page) in &pages {
        problems.extend(check_blocks(file, page, tmp.path(), &mut tools, &mut counts));
        problems.extend(check_links(file, page, &pages, root));
        problems.extend(check_shell(file, page, root));
    }
    (counts, problems)
}

#[test]
fn every_example_loads_and_every_link_resolves() {
    let root = repo();
    let files = markdown_files();
    let (counts, problems) = check_all(&root, &files);
    eprintln!("checked {} files; YAML blocks by kind: {counts:?}", files.len());
    assert!(
        problems.is_empty(),
        "{} problem(s) in the docs:\n{}",
        problems.len(),
        problems.join("\n")
    );
    // The docs show rules and settings; finding none means the fences were not found at all.
    assert!(
        counts.get("rules").copied().unwrap_or(0) >= 5,
        "too few rules examples found: {counts:?}"
    );
    assert!(counts.contains_key("settings"), "no settings example found: {counts:?}");
}

/// The checks themselves, on a page made to break each of them: they must be able to fail.
#[test]
fn the_checks_catch_each_kind_of_problem() {
    let dir = TempDir::new().expect("temporary directory");
    let root = dir.path();
    fs::create_dir(root.join("docs")).unwrap();
    fs::write(root.join("docs/other.md"), "# Other page\n\n## Same\n\n## Same\n").unwrap();
    let page = "# Title\n\n\
        ```yaml\nplain: true\n```\n\n\
        ```yaml rulez\ndomain: x\n```\n\n\
        ```yaml rules\ndomain: x\ndescriptors:\n  - {key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}\n```\n\n\
        ```yaml rules\ndomain: x\n```\n\n\
        ```yaml rules-invalid\ndomain: x\ndescriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 1}}]\n```\n\n\
        ```yaml settings\nlog: {level: \"not a [filter\"}\n```\n\n\
        ```yaml settings\ngrpc_adr: 127.0.0.1:1\n```\n\n\
        ```yaml envoy-fragment\njust a string\n```\n\n\
        ```yaml compose\nservices:\n  a: {image: x, depends_on: [b]}\n```\n\n\
        ```yaml rules\ndomain: y\ndescriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 1}}]\n```\n\n\
        ```sh\ntollgate check --rules no/such/dir\nmkdir -p mine && tollgate check --rules mine\n```\n\n\
        [gone](missing.md) [ok](other.md#same-1) [bad anchor](other.md#nope) [self](#title) \
        [up](../README.md)\n";
    fs::write(root.join("docs/page.md"), page).unwrap();
    let (counts, problems) = check_all(root, &[PathBuf::from("docs/page.md")]);
    let expect = [
        "docs/page.md:3: a plain ```yaml fence",
        "docs/page.md:7: ```yaml rulez: unknown kind `rulez`",
        "docs/page.md:11: ```yaml rules: rules do not load",
        "docs/page.md:17: ```yaml rules: rules load but declare no descriptor",
        "docs/page.md:21: ```yaml rules-invalid: shown as refused, but these rules load",
        "docs/page.md:26: ```yaml settings: settings do not validate",
        "docs/page.md:30: ```yaml settings: settings:",
        "docs/page.md:34: ```yaml envoy-fragment: an Envoy fragment must be a YAML mapping or sequence",
        "docs/page.md:38: ```yaml compose: service `a` depends on `b`",
        "docs/page.md:53: link `missing.md`: docs/missing.md does not exist",
        "docs/page.md:53: link `other.md#nope`: docs/other.md has no heading with anchor `#nope`",
        "docs/page.md:53: link `../README.md`: README.md does not exist",
        "docs/page.md:49: `--rules no/such/dir`: no such path",
    ];
    for (expected, problem) in expect.iter().zip(&problems) {
        assert!(
            problem.starts_with(expected),
            "expected `{expected}...`, got `{problem}`\nall:\n{}",
            problems.join("\n")
        );
    }
    assert_eq!(problems.len(), expect.len(), "problems:\n{}", problems.join("\n"));
    assert_eq!(counts.get("rules"), Some(&1), "{counts:?}");
}

#[test]
fn anchors_follow_github() {
    let page = parse_page(
        "# Tollgate\n## Try it with Envoy\n## The `bucket` admin API\n### What a decision means?\n\
         ## envoyproxy/ratelimit's schema\n## Schedules and quotas\n## Schedules and quotas\n\
         ## Ports & endpoints\n## `rate_limit: {unit, requests_per_unit}`\n",
    );
    let expected: BTreeSet<String> = [
        "tollgate",
        "try-it-with-envoy",
        "the-bucket-admin-api",
        "what-a-decision-means",
        "envoyproxyratelimits-schema",
        "schedules-and-quotas",
        "schedules-and-quotas-1",
        "ports--endpoints",
        "rate_limit-unit-requests_per_unit",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(page.anchors, expected);
}

/// The external checkers accept a good block and refuse a bad one (each skipped, with a note,
/// when its tool is missing and `CI` is not `true`).
#[test]
fn the_external_checkers_refuse_bad_blocks() {
    let tmp = TempDir::new().expect("temporary directory");
    let mut tools = Tools::default();
    let envoy_good = "static_resources:\n  clusters:\n    - name: ratelimit\n      type: STATIC\n      \
        typed_extension_protocol_options:\n        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n          \
        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n          \
        explicit_http_config: {http2_protocol_options: {}}\n      load_assignment:\n        cluster_name: ratelimit\n        \
        endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8081}}}}]}]\n";
    let envoy_bad = "static_resources:\n  clusters:\n    - name: ratelimit\n      type: NOT_A_TYPE\n";
    let k8s_good = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: rules}\ndata: {a.yaml: \"domain: a\"}\n";
    let k8s_bad = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: rules}\ndatas: {a.yaml: \"domain: a\"}\n";
    let rules_good = "groups:\n  - name: t\n    rules:\n      - alert: A\n        expr: up == 0\n";
    let rules_bad = "groups:\n  - name: t\n    rules:\n      - alert: A\n        expr: up ==\n";
    let config_good = "scrape_configs:\n  - job_name: t\n    static_configs: [{targets: [\"127.0.0.1:8080\"]}]\n";
    let config_bad = "scrape_configs:\n  - job_name: t\n    scrape_interval: soon\n";
    // A custom resource: kubernetes-validate only warns on it; a typo must still fail.
    let monitor = "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: t}\n\
        spec:\n  namespaceSelector: {matchNames: [t]}\n  selector:\n    matchLabels: {app: t}\n  endpoints: [{port: http}]\n";
    let monitor_bad = monitor.replace("matchLabels", "matchLabelz");
    // Envoy Gateway's and AI Gateway's kinds: a value outside an enumeration, or a required key
    // left out, must fail too.
    let policy = "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: BackendTrafficPolicy\nmetadata: {name: t}\n\
        spec:\n  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: eg}]\n  rateLimit:\n    \
        global:\n      rules:\n        - clientSelectors: [{headers: [{name: x-tenant, type: Distinct}]}]\n          \
        limit: {requests: 10, unit: Hour}\n          cost:\n            request: {from: Number, number: 0}\n            \
        response: {from: Metadata, metadata: {namespace: io.envoy.ai_gateway, key: llm_total_token}}\n";
    let policy_bad_unit = policy.replace("unit: Hour", "unit: hour");
    let policy_no_key = policy.replace(", key: llm_total_token", "");
    let route = "apiVersion: aigateway.envoyproxy.io/v1beta1\nkind: AIGatewayRoute\nmetadata: {name: t}\n\
        spec:\n  parentRefs: [{name: eg}]\n  rules: [{backendRefs: [{name: b}]}]\n  \
        llmRequestCosts: [{metadataKey: llm_total_token, type: TotalToken}]\n";
    let route_bad_type = route.replace("type: TotalToken", "type: TotalTokens");
    let unknown_kind = "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: t}\nspec: {}\n";
    for (kind, good, bad) in [
        ("envoy", envoy_good, envoy_bad),
        ("kubernetes", k8s_good, k8s_bad),
        ("kubernetes", monitor, monitor_bad.as_str()),
        ("kubernetes", k8s_good, unknown_kind),
        ("kubernetes", policy, policy_bad_unit.as_str()),
        ("kubernetes", policy, policy_no_key.as_str()),
        ("kubernetes", route, route_bad_type.as_str()),
        ("prometheus-rules", rules_good, rules_bad),
        ("prometheus-config", config_good, config_bad),
    ] {
        match check_yaml(kind, good, tmp.path(), &mut tools) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => panic!("a good `{kind}` block is refused: {e}"),
        }
        let refused = check_yaml(kind, bad, tmp.path(), &mut tools);
        assert!(refused.is_err(), "a bad `{kind}` block passes: {refused:?}");
    }
}

/// Every field of the rules model (`src/rules/file/model.rs`, both schemas) is documented in the
/// rules reference or on the schedules page, so a new field cannot go undocumented.
#[test]
fn every_rules_field_is_documented() {
    let root = repo();
    let model = fs::read_to_string(root.join("src/rules/file/model.rs")).expect("read src/rules/file/model.rs");
    let docs = ["docs/rules.md", "docs/schedules-and-quotas.md"]
        .map(|f| fs::read_to_string(root.join(f)).unwrap_or_else(|e| panic!("read {f}: {e}")))
        .join("\n");
    let fields: BTreeSet<&str> = model
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub "))
        .filter(|l| !l.starts_with("fn ") && !l.starts_with("struct ") && !l.starts_with("enum "))
        .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim()))
        .collect();
    assert!(fields.len() >= 20, "too few fields read from model.rs: {fields:?}");
    let missing: Vec<&&str> = fields.iter().filter(|f| !docs.contains(&format!("`{f}`"))).collect();
    assert!(
        missing.is_empty(),
        "rules fields without a mention in docs/rules.md or docs/schedules-and-quotas.md: {missing:?}"
    );
}
