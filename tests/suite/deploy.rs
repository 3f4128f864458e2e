//! The deployment files against the repository and tollgate itself: `docker-compose.yml` (and
//! `docker-compose.postgres.yml`), the Kubernetes set in `deploy/kubernetes/` and the Istio set in
//! `deploy/istio/`.
//!
//! Every manifest is validated with `kubernetes-validate --strict` (the EnvoyFilter CRD, which it
//! has no schema for, is checked here by structure and by splicing its patches into an Envoy
//! bootstrap that `envoy --mode validate` accepts). Everything the files name is checked to
//! exist: mounted files, ports (against the settings tollgate loads with the files' environment),
//! environment variables (each must be a setting: `unknown_env_vars` stays empty), probe and
//! health-check paths (200 on a running tollgate started with that environment), the rules a
//! ConfigMap carries (tollgate's loader), and the descriptors the Istio route actions produce
//! (sent to a tollgate running the shipped rules, each must reach a bucket).

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;
use support::{envoy_or_skip, envoy_validate, http_get, Envoy, Tollgate};
use tollgate::server::settings::{Backend, Settings};

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Every YAML document in file `relative` (of the repository).
fn yaml_docs(relative: &str) -> Vec<Value> {
    let text = fs::read_to_string(repo_path(relative)).unwrap_or_else(|e| panic!("read {relative}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{relative}: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn yaml(relative: &str) -> Value {
    let mut docs = yaml_docs(relative);
    assert_eq!(docs.len(), 1, "{relative}: expected one YAML document");
    docs.pop().unwrap()
}

/// `value[path...]` as a string; panics naming the path when it is missing or not a string.
fn str_at<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    at(value, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string in {value:?}"))
}

fn at<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    let mut v = value;
    for key in path {
        v = match v {
            Value::Mapping(m) => m
                .get(*key)
                .unwrap_or_else(|| panic!("no {key:?} (of {path:?}) in {v:?}")),
            Value::Sequence(s) => {
                &s[key
                    .parse::<usize>()
                    .unwrap_or_else(|_| panic!("{key:?} is not an index"))]
            }
            other => panic!("{path:?}: {other:?} has no {key:?}"),
        };
    }
    v
}

fn seq(value: &Value) -> &Vec<Value> {
    value.as_sequence().unwrap_or_else(|| panic!("not a list: {value:?}"))
}

fn strings(value: &Value) -> Vec<String> {
    seq(value)
        .iter()
        .map(|v| v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}")).to_owned())
        .collect()
}

/// The settings `tollgate serve` gets from `config/tollgate.yaml` (what the image bakes in and
/// compose mounts) and environment `env` alone; also every variable of `env` must name a setting.
#[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
fn settings_with_env(env: &BTreeMap<String, String>) -> Settings {
    let mut loaded = None;
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in env {
            jail.set_env(k, v);
        }
        let settings = Settings::load(Some(&repo_path("config/tollgate.yaml"))).map_err(|e| e.to_string())?;
        settings.validate()?;
        let unknown = tollgate::server::settings::unknown_env_vars();
        assert!(unknown.is_empty(), "variables naming no setting: {unknown:?}");
        loaded = Some(settings);
        Ok(())
    });
    loaded.unwrap()
}

/// `http://host:port/path` split into host, port and path.
fn split_url(url: &str) -> (String, u16, String) {
    let rest = url.split_once("://").unwrap_or_else(|| panic!("{url}: no scheme")).1;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, String::new()), |(a, p)| (a, format!("/{p}")));
    let authority = authority.rsplit('@').next().unwrap();
    let (host, port) = authority.rsplit_once(':').unwrap_or_else(|| panic!("{url}: no port"));
    (host.to_owned(), port.parse().expect("a port number"), path)
}

/// Runs `tollgate probe` against `url` with its port replaced by `port` (of a test server).
fn probe(url: &str, port: u16) -> std::process::Output {
    let (host, _, path) = split_url(url);
    assert_eq!(
        host, "127.0.0.1",
        "{url}: a health check inside the container asks loopback"
    );
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["probe", &format!("http://127.0.0.1:{port}{path}")])
        .output()
        .expect("run tollgate probe")
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml

fn compose() -> Value {
    yaml("docker-compose.yml")
}

fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
    at(compose, &["services", name])
}

/// A service's `environment`, as a map (the mapping form is the one used).
fn compose_env(service: &Value) -> BTreeMap<String, String> {
    let Some(env) = service.get("environment") else {
        return BTreeMap::new();
    };
    env.as_mapping()
        .expect("environment as a mapping")
        .iter()
        .map(|(k, v)| {
            let value = match v {
                Value::String(s) => s.clone(),
                other => serde_yaml::to_string(other).unwrap().trim().to_owned(),
            };
            (k.as_str().unwrap().to_owned(), value)
        })
        .collect()
}

/// The healthcheck `test` of a service, exec form (`["CMD", ...]`) without the `CMD`.
fn healthcheck(service: &Value) -> Vec<String> {
    let test = strings(at(service, &["healthcheck", "test"]));
    assert_eq!(
        test.first().map(String::as_str),
        Some("CMD"),
        "exec-form health checks: {test:?}"
    );
    test[1..].to_vec()
}

/// `(host path, container path)` of each bind mount of a service.
fn bind_mounts(service: &Value) -> Vec<(String, String)> {
    service
        .get("volumes")
        .map(strings)
        .unwrap_or_default()
        .into_iter()
        .map(|v| {
            let mut parts = v.split(':');
            let host = parts.next().unwrap().to_owned();
            let container = parts
                .next()
                .unwrap_or_else(|| panic!("{v}: no container path"))
                .to_owned();
            (host, container)
        })
        .collect()
}

/// The Envoy demo's listener port and its clusters' `(address, port)` by name.
fn envoy_demo_ports() -> (u16, BTreeMap<String, (String, u16)>) {
    let envoy = yaml("envoy/envoy.yaml");
    let listeners = seq(at(&envoy, &["static_resources", "listeners"]));
    assert_eq!(listeners.len(), 1);
    let listener = at(&listeners[0], &["address", "socket_address", "port_value"])
        .as_u64()
        .unwrap();
    let clusters = seq(at(&envoy, &["static_resources", "clusters"]))
        .iter()
        .map(|c| {
            let socket = at(
                c,
                &[
                    "load_assignment",
                    "endpoints",
                    "0",
                    "lb_endpoints",
                    "0",
                    "endpoint",
                    "address",
                    "socket_address",
                ],
            );
            let port = at(socket, &["port_value"]).as_u64().unwrap();
            (
                str_at(c, &["name"]).to_owned(),
                (str_at(socket, &["address"]).to_owned(), u16::try_from(port).unwrap()),
            )
        })
        .collect();
    (u16::try_from(listener).unwrap(), clusters)
}

#[test]
fn compose_file_names_only_what_exists() {
    let compose = compose();
    let names: BTreeSet<&str> = at(&compose, &["services"])
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(names, BTreeSet::from(["envoy", "redis", "tollgate", "upstream"]));
    let tollgate = service(&compose, "tollgate");
    assert_eq!(str_at(tollgate, &["build"]), ".");
    assert!(repo_path("Dockerfile").is_file());
    assert_eq!(at(tollgate, &["read_only"]).as_bool(), Some(true));

    // Every bind mount's source exists; tollgate's config goes where the image's WORKDIR
    // expects it (so `rules: config/rules` of config/tollgate.yaml finds it).
    let dockerfile = fs::read_to_string(repo_path("Dockerfile")).unwrap();
    assert!(dockerfile.contains("WORKDIR /srv/tollgate\n"));
    for name in &names {
        for (host, _) in bind_mounts(service(&compose, name)) {
            let relative = host
                .strip_prefix("./")
                .unwrap_or_else(|| panic!("{name}: {host} is not ./relative"));
            assert!(
                repo_path(relative).exists(),
                "{name} mounts {host}, which is not in the repository"
            );
        }
    }
    assert_eq!(
        bind_mounts(tollgate),
        [("./config".to_owned(), "/srv/tollgate/config".to_owned())]
    );

    // Envoy 1.40 (the version the tests run) with the demo's own bootstrap, mounted where its
    // command reads it.
    let envoy = service(&compose, "envoy");
    assert_eq!(str_at(envoy, &["image"]), "envoyproxy/envoy:v1.40.0");
    let mounts = bind_mounts(envoy);
    assert_eq!(mounts.len(), 1);
    assert_eq!(mounts[0].0, "./envoy/envoy.yaml");
    let command = strings(at(envoy, &["command"]));
    let config_arg = command.iter().position(|a| a == "-c").expect("envoy -c <file>");
    assert_eq!(command[config_arg + 1], mounts[0].1);

    // Envoy and the upstream share tollgate's network namespace: the demo's loopback addresses
    // then point at tollgate and the upstream, and the published ports are tollgate's.
    for name in ["envoy", "upstream"] {
        assert_eq!(
            str_at(service(&compose, name), &["network_mode"]),
            "service:tollgate",
            "{name}"
        );
        assert!(
            service(&compose, name).get("ports").is_none(),
            "{name}: ports go on tollgate"
        );
    }
    let settings = settings_with_env(&compose_env(tollgate));
    let (listener, clusters) = envoy_demo_ports();
    assert_eq!(
        clusters["ratelimit"],
        (
            "127.0.0.1".to_owned(),
            settings.grpc_addr.tcp().expect("a TCP gRPC address").port()
        )
    );
    let upstream_port = clusters["upstream"].1;
    let upstream_command = strings(at(service(&compose, "upstream"), &["command"]));
    assert!(
        upstream_command
            .windows(2)
            .any(|w| w[0] == upstream_port.to_string() || w[1] == upstream_port.to_string()),
        "the upstream must listen on {upstream_port}: {upstream_command:?}"
    );
    assert!(
        upstream_command.contains(&"127.0.0.1".to_owned()),
        "{upstream_command:?}"
    );
    // Published on the host's loopback only (the gRPC API takes refunds, /config shows the
    // rules): `127.0.0.1:HOST:CONTAINER`, the same port outside.
    for name in &names {
        for p in service(&compose, name).get("ports").map(strings).unwrap_or_default() {
            assert!(
                p.starts_with("127.0.0.1:") && p.split(':').count() == 3,
                "{name}: {p} is published beyond the host's loopback (write 127.0.0.1:{p})"
            );
        }
    }
    let published: BTreeSet<u16> = strings(at(tollgate, &["ports"]))
        .iter()
        .map(|p| {
            let mut parts = p.split(':').skip(1);
            let (host, container) = (parts.next().unwrap(), parts.next().unwrap());
            assert_eq!(host, container, "{p}: the same port outside");
            container.parse().unwrap()
        })
        .collect();
    assert_eq!(
        published,
        BTreeSet::from([
            listener,
            settings.grpc_addr.tcp().expect("a TCP gRPC address").port(),
            settings.http_addr.port()
        ])
    );

    // The environment: real settings (checked by settings_with_env), Redis at the `redis` service.
    assert_eq!(settings.backend, Backend::Redis);
    assert_eq!(settings.redis.urls.len(), 1);
    let (host, port, _) = split_url(&settings.redis.urls[0]);
    assert!(names.contains(host.as_str()), "Redis URL host {host} is no service");
    assert_eq!(port, 6379);
    assert_eq!(healthcheck(service(&compose, "redis")), ["redis-cli", "ping"]);

    // Health checks: tollgate's is `tollgate probe` on its own HTTP port.
    let check = healthcheck(tollgate);
    assert_eq!(check[..2], ["/usr/local/bin/tollgate", "probe"]);
    assert_eq!(split_url(&check[2]).1, settings.http_addr.port());
    assert_eq!(split_url(&check[2]).2, "/readyz");
    // `depends_on: service_healthy` only on services that have a health check.
    for name in &names {
        let Some(deps) = service(&compose, name).get("depends_on") else {
            continue;
        };
        for (dep, condition) in deps.as_mapping().unwrap() {
            let dep = dep.as_str().unwrap();
            assert!(names.contains(dep), "{name} depends on unknown {dep}");
            if str_at(condition, &["condition"]) == "service_healthy" {
                assert!(
                    service(&compose, dep).get("healthcheck").is_some(),
                    "{dep} has no health check"
                );
            }
        }
    }
}

/// Compose's merge of override file `over` onto `base` (the compose specification's rules for
/// the shapes these files use): mappings merge key by key, sequences of `profiles`, `ports` and
/// the like are appended, a scalar replaces, `!override` replaces the whole value and `!reset`
/// removes it.
fn compose_merge(base: &Value, over: &Value) -> Value {
    match over {
        Value::Tagged(tagged) if tagged.tag == "override" => tagged.value.clone(),
        Value::Tagged(tagged) if tagged.tag == "reset" => Value::Null,
        Value::Tagged(tagged) => panic!("compose has no tag {}", tagged.tag),
        Value::Mapping(over_map) => {
            let mut merged = base.as_mapping().cloned().unwrap_or_default();
            for (k, v) in over_map {
                let value = compose_merge(merged.get(k).unwrap_or(&Value::Null), v);
                if value.is_null() {
                    merged.remove(k);
                } else {
                    merged.insert(k.clone(), value);
                }
            }
            Value::Mapping(merged)
        }
        Value::Sequence(over_seq) => {
            let mut merged = base.as_sequence().cloned().unwrap_or_default();
            merged.extend(
                over_seq
                    .iter()
                    .filter(|v| !merged.contains(v))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
            Value::Sequence(merged)
        }
        scalar => scalar.clone(),
    }
}

/// `docker compose -f docker-compose.yml -f docker-compose.postgres.yml config`, as
/// `compose_merge` makes it.
fn compose_postgres() -> Value {
    compose_merge(&compose(), &yaml("docker-compose.postgres.yml"))
}

/// The services `docker compose up` starts: those without `profiles`.
fn started_services(compose: &Value) -> BTreeSet<String> {
    at(compose, &["services"])
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.get("profiles").is_none())
        .map(|(k, _)| k.as_str().unwrap().to_owned())
        .collect()
}

/// `docker-compose.postgres.yml` over `docker-compose.yml`: the same tollgate on Postgres, with
/// nothing of Redis left: no `TOLLGATE_REDIS__*` variable, no dependency on the `redis`
/// service, which is not started.
#[test]
fn compose_postgres_override_names_real_settings() {
    let merged = compose_postgres();
    let env = compose_env(service(&merged, "tollgate"));
    let redis_env: Vec<&String> = env.keys().filter(|k| k.starts_with("TOLLGATE_REDIS")).collect();
    assert!(redis_env.is_empty(), "the Postgres variant still sets {redis_env:?}");
    let deps: BTreeSet<&str> = at(service(&merged, "tollgate"), &["depends_on"])
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(deps, BTreeSet::from(["postgres"]), "tollgate waits for Postgres only");
    let started = started_services(&merged);
    assert!(
        !started.contains("redis"),
        "Redis is started with the Postgres variant: {started:?}"
    );
    for name in &started {
        for dep in service(&merged, name)
            .get("depends_on")
            .and_then(Value::as_mapping)
            .into_iter()
            .flatten()
        {
            let dep = dep.0.as_str().unwrap();
            assert!(started.contains(dep), "{name} depends on {dep}, which is not started");
        }
    }
    let settings = settings_with_env(&env);
    assert_eq!(settings.backend, Backend::Postgres);
    assert_eq!(
        env.get("TOLLGATE_LOG__FORMAT"),
        compose_env(service(&compose(), "tollgate")).get("TOLLGATE_LOG__FORMAT"),
        "the rest of the environment stays the base file's"
    );
    let postgres = service(&merged, "postgres");
    let pg_env = compose_env(postgres);
    let (host, port, path) = split_url(&settings.postgres.url);
    assert_eq!(host, "postgres", "the URL names the postgres service");
    assert_eq!(port, 5432);
    assert_eq!(path.trim_start_matches('/'), pg_env["POSTGRES_DB"]);
    assert!(settings
        .postgres
        .url
        .starts_with(&format!("postgres://{}@", pg_env["POSTGRES_USER"])));
    assert_eq!(
        settings.postgres.password.as_deref(),
        Some(pg_env["POSTGRES_PASSWORD"].as_str())
    );
    let check = healthcheck(postgres);
    assert_eq!(check[0], "pg_isready");
    let deps = at(service(&merged, "tollgate"), &["depends_on", "postgres", "condition"]);
    assert_eq!(deps.as_str(), Some("service_healthy"));
}

/// Compose's tollgate environment on a real tollgate (Redis at the shared test server instead
/// of the `redis` service): it starts, every health check answers, and the demo bootstrap
/// validates.
#[test]
fn compose_tollgate_environment_serves_and_its_health_checks_pass() {
    let test = "compose_tollgate_environment_serves_and_its_health_checks_pass";
    let Some(redis_url) = support::redis::shared_redis(test) else {
        return;
    };
    let compose = compose();
    let mut builder = Tollgate::builder().rules_path(repo_path("config/rules"));
    for (k, v) in compose_env(service(&compose, "tollgate")) {
        let v = if k == "TOLLGATE_REDIS__URLS" {
            format!("[{redis_url}]")
        } else {
            v
        };
        builder = builder.env(&k, &v);
    }
    let prefix = support::redis::unique_prefix(test);
    let tollgate = builder.env("TOLLGATE_REDIS__KEY_PREFIX", &prefix).start();
    let config: serde_json::Value = serde_json::from_str(&tollgate.config().expect("/config").1).expect("/config JSON");
    assert_eq!(config["settings"]["backend"], "redis");
    assert_eq!(config["settings"]["redis"]["key_prefix"], prefix.as_str());
    let check = healthcheck(service(&compose, "tollgate"));
    let out = probe(&check[2], tollgate.http_addr.port());
    assert!(out.status.success(), "{out:?}");
    // The probe fails on a path tollgate does not serve, so the check above could fail.
    let out = probe("http://127.0.0.1:1/nothing-here", tollgate.http_addr.port());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let (host, port) = redis_url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap()
        .rsplit_once(':')
        .unwrap();
    let mut cli = healthcheck(service(&compose, "redis"));
    let program = cli.remove(0);
    let pong = Command::new(program)
        .args(["-h", host, "-p", port])
        .args(&cli)
        .output()
        .expect("run redis-cli");
    assert_eq!(String::from_utf8_lossy(&pong.stdout).trim(), "PONG");

    if let Some(envoy) = envoy_or_skip(test) {
        envoy_validate(&envoy, &repo_path("envoy/envoy.yaml")).expect("envoy --mode validate envoy/envoy.yaml");
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

/// A kustomization's resource files (directories are other kustomizations, read in turn), and
/// its ConfigMap generators `(name, files)`, with paths relative to the repository.
struct Kustomization {
    files: Vec<String>,
    generators: Vec<(String, Vec<String>, Option<String>)>,
    namespace: Option<String>,
}

fn kustomization(dir: &str) -> Kustomization {
    let k = yaml(&format!("{dir}/kustomization.yaml"));
    assert_eq!(str_at(&k, &["kind"]), "Kustomization");
    let mut out = Kustomization {
        files: Vec::new(),
        generators: Vec::new(),
        namespace: k.get("namespace").and_then(Value::as_str).map(str::to_owned),
    };
    for resource in strings(at(&k, &["resources"])) {
        let path = normalize(&format!("{dir}/{resource}"));
        assert!(
            repo_path(&path).exists(),
            "{dir}/kustomization.yaml names {resource}, which does not exist"
        );
        if repo_path(&path).is_dir() {
            let base = kustomization(&path);
            out.files.extend(base.files);
            for (name, files, behavior) in base.generators {
                out.generators.retain(|(n, _, _)| *n != name);
                out.generators.push((name, files, behavior));
            }
            out.namespace = out.namespace.or(base.namespace);
        } else {
            out.files.push(path);
        }
    }
    for generator in k.get("configMapGenerator").map(seq).into_iter().flatten() {
        let name = str_at(generator, &["name"]).to_owned();
        let files: Vec<String> = strings(at(generator, &["files"]))
            .iter()
            .map(|f| normalize(&format!("{dir}/{f}")))
            .collect();
        for f in &files {
            assert!(
                repo_path(f).is_file(),
                "{dir}: configMapGenerator file {f} does not exist"
            );
        }
        let behavior = generator.get("behavior").and_then(Value::as_str).map(str::to_owned);
        if behavior.as_deref() == Some("replace") {
            assert!(
                out.generators.iter().any(|(n, _, _)| *n == name),
                "{dir}: replaces ConfigMap {name}, which its bases do not make"
            );
        }
        out.generators.retain(|(n, _, _)| *n != name);
        out.generators.push((name, files, behavior));
    }
    out
}

/// `a/b/../c` as `a/c`.
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            ".." => {
                parts.pop();
            }
            "." | "" => {}
            p => parts.push(p),
        }
    }
    parts.join("/")
}

/// The documents of all the files, each with the file it came from.
fn manifests(files: &[String]) -> Vec<(String, Value)> {
    files
        .iter()
        .flat_map(|f| yaml_docs(f).into_iter().map(move |d| (f.clone(), d)))
        .collect()
}

fn find<'a>(docs: &'a [(String, Value)], kind: &str, name: &str) -> &'a Value {
    &docs
        .iter()
        .find(|(_, d)| str_at(d, &["kind"]) == kind && str_at(d, &["metadata", "name"]) == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
        .1
}

fn kubernetes_validate(test: &str, files: &[PathBuf]) {
    let Some(tool) = support::tools::tool_or_skip(test, "kubernetes-validate") else {
        return;
    };
    let out = Command::new(tool)
        .arg("--strict")
        .args(files)
        .output()
        .expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubernetes-validate --strict:\n{text}");
    // It only warns when it has no schema for a kind: none of these files may contain one.
    assert!(!text.contains("WARN"), "kubernetes-validate --strict:\n{text}");
    assert_eq!(
        text.matches(" passed for resource ").count(),
        count_docs(files),
        "{text}"
    );
}

fn count_docs(files: &[PathBuf]) -> usize {
    files
        .iter()
        .map(|f| {
            let text = fs::read_to_string(f).unwrap();
            serde_yaml::Deserializer::from_str(&text)
                .map(|d| Value::deserialize(d).expect("YAML"))
                .filter(|v| !v.is_null())
                .count()
        })
        .sum()
}

/// The rendered manifests of `kubectl kustomize <dir>` (kubectl is on the machines; under
/// `CI=true` its absence fails): validated like the files, EnvoyFilters left out.
fn kustomize_rendered(test: &str, dir: &str) -> Option<Vec<Value>> {
    let kubectl = support::tools::tool_or_skip(test, "kubectl")?;
    let out = Command::new(kubectl)
        .args(["kustomize"])
        .arg(repo_path(dir))
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    Some(
        serde_yaml::Deserializer::from_str(&text)
            .map(|d| Value::deserialize(d).unwrap())
            .filter(|d| !d.is_null())
            .collect(),
    )
}

#[test]
fn kubernetes_and_istio_manifests_pass_kubernetes_validate_strict() {
    let test = "kubernetes_and_istio_manifests_pass_kubernetes_validate_strict";
    for dir in ["deploy/kubernetes", "deploy/istio"] {
        let k = kustomization(dir);
        // Every manifest file of the directory is applied (a file left out of `resources:` is
        // neither applied nor validated).
        for entry in fs::read_dir(repo_path(dir)).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".yaml") && name != "kustomization.yaml" {
                let path = format!("{dir}/{name}");
                assert!(k.files.contains(&path), "{path} is not in {dir}/kustomization.yaml");
            }
        }
        // EnvoyFilter and Gateway are Istio's CRDs: no schema; checked in the Istio tests.
        let istio = |d: &Value| ["EnvoyFilter", "Gateway"].contains(&str_at(d, &["kind"]));
        let files: Vec<PathBuf> = k
            .files
            .iter()
            .filter(|f| manifests(&[(*f).clone()]).iter().all(|(_, d)| !istio(d)))
            .map(|f| repo_path(f))
            .collect();
        assert!(!files.is_empty());
        kubernetes_validate(test, &files);
        if let Some(rendered) = kustomize_rendered(test, dir) {
            let tmp = tempfile::tempdir().unwrap();
            let path = tmp.path().join("rendered.yaml");
            let docs: Vec<String> = rendered
                .iter()
                .filter(|d| !istio(d))
                .map(|d| serde_yaml::to_string(d).unwrap())
                .collect();
            fs::write(&path, docs.join("---\n")).unwrap();
            kubernetes_validate(test, &[path]);
            // The generated ConfigMap holds exactly the generator's files.
            let (name, files, _) = k.generators.last().unwrap();
            let cm = rendered
                .iter()
                .find(|d| str_at(d, &["kind"]) == "ConfigMap" && str_at(d, &["metadata", "name"]) == name)
                .expect("the rules ConfigMap");
            let keys: BTreeSet<&str> = at(cm, &["data"])
                .as_mapping()
                .unwrap()
                .keys()
                .map(|k| k.as_str().unwrap())
                .collect();
            let expected: BTreeSet<&str> = files.iter().map(|f| f.rsplit('/').next().unwrap()).collect();
            assert_eq!(keys, expected, "{dir}");
        }
    }
}

/// The container `name` of Deployment `deployment`.
fn named_container<'a>(docs: &'a [(String, Value)], deployment: &str, name: &str) -> &'a Value {
    let deployment = find(docs, "Deployment", deployment);
    seq(at(deployment, &["spec", "template", "spec", "containers"]))
        .iter()
        .find(|c| str_at(c, &["name"]) == name)
        .unwrap_or_else(|| panic!("a container named {name}"))
}

/// The tollgate container of the Deployment, and its environment given as values.
fn container(docs: &[(String, Value)]) -> (&Value, BTreeMap<String, String>) {
    let c = named_container(docs, "tollgate", "tollgate");
    let env = c
        .get("env")
        .map(seq)
        .into_iter()
        .flatten()
        .filter(|e| e.get("valueFrom").is_none())
        .map(|e| (str_at(e, &["name"]).to_owned(), str_at(e, &["value"]).to_owned()))
        .collect();
    (c, env)
}

/// A container's variables taken from Secrets: name to `(secret, key)`. Every one names a Secret
/// of `docs` that has the key.
fn secret_env(docs: &[(String, Value)], c: &Value) -> BTreeMap<String, (String, String)> {
    c.get("env")
        .map(seq)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let from = e.get("valueFrom")?;
            let secret = str_at(from, &["secretKeyRef", "name"]).to_owned();
            let key = str_at(from, &["secretKeyRef", "key"]).to_owned();
            let data = find(docs, "Secret", &secret);
            let has = ["stringData", "data"]
                .iter()
                .any(|d| data.get(*d).and_then(|m| m.get(key.as_str())).is_some());
            assert!(has, "Secret {secret} has no key {key}");
            Some((str_at(e, &["name"]).to_owned(), (secret, key)))
        })
        .collect()
}

/// A NetworkPolicy's ingress rules as `(ports, from)`.
fn policy_rules(policy: &Value) -> Vec<(BTreeSet<u64>, Vec<Value>)> {
    seq(at(policy, &["spec", "ingress"]))
        .iter()
        .map(|rule| {
            let ports = seq(at(rule, &["ports"]))
                .iter()
                .map(|p| at(p, &["port"]).as_u64().expect("numeric ports"))
                .collect();
            let from = rule.get("from").map(seq).cloned().unwrap_or_default();
            (ports, from)
        })
        .collect()
}

/// The NetworkPolicies: tollgate's gRPC port only from the gateway's pods (a selector on
/// namespace and pods, not everyone), its HTTP port from the monitoring namespace and its own,
/// Redis only from tollgate's pods; each policy selects the pods it is named for.
#[test]
fn network_policies_admit_only_envoys_prometheus_and_tollgate() {
    let k = kustomization("deploy/kubernetes");
    let docs = manifests(&k.files);
    let pod_labels = |name: &str| {
        labels(at(
            find(&docs, "Deployment", name),
            &["spec", "template", "metadata", "labels"],
        ))
    };
    let tollgate_pods = pod_labels("tollgate");
    let redis_pods = pod_labels("tollgate-redis");
    let selects = |selector: &Value, pods: &BTreeMap<String, String>| {
        let wanted = labels(at(selector, &["matchLabels"]));
        !wanted.is_empty() && wanted.iter().all(|(k, v)| pods.get(k) == Some(v))
    };
    let (_, env) = container(&docs);
    let settings = settings_with_env(&env);
    let (grpc, http) = (
        u64::from(settings.grpc_addr.tcp().expect("a TCP gRPC address").port()),
        u64::from(settings.http_addr.port()),
    );

    let policy = find(&docs, "NetworkPolicy", "tollgate");
    assert!(selects(at(policy, &["spec", "podSelector"]), &tollgate_pods));
    assert_eq!(strings(at(policy, &["spec", "policyTypes"])), ["Ingress"]);
    let rules = policy_rules(policy);
    let opened: BTreeSet<u64> = rules.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    assert_eq!(opened, BTreeSet::from([grpc, http]), "only tollgate's two ports");
    for (ports, from) in &rules {
        assert!(!from.is_empty(), "{ports:?} open to every source");
        if ports.contains(&grpc) {
            assert_eq!(ports, &BTreeSet::from([grpc]), "the gRPC rule opens only the gRPC port");
            for peer in from {
                assert!(
                    peer.get("namespaceSelector").is_some() && peer.get("podSelector").is_some(),
                    "gRPC from a namespace and pod selector together (the gateway's pods): {peer:?}"
                );
                assert!(
                    !labels(at(peer, &["podSelector", "matchLabels"])).is_empty(),
                    "gRPC from chosen pods, not every pod of a namespace: {peer:?}"
                );
            }
        } else {
            assert_eq!(ports, &BTreeSet::from([http]));
            let namespaces: Vec<String> = from
                .iter()
                .filter_map(|p| p.get("namespaceSelector"))
                .map(|s| str_at(s, &["matchLabels", "kubernetes.io/metadata.name"]).to_owned())
                .collect();
            assert_eq!(namespaces, ["monitoring"]);
            assert!(
                from.iter().any(|p| p.get("namespaceSelector").is_none()
                    && p.get("podSelector")
                        .and_then(Value::as_mapping)
                        .is_some_and(|m| m.is_empty())),
                "HTTP from tollgate's own namespace (podSelector: {{}})"
            );
        }
    }

    let policy = find(&docs, "NetworkPolicy", "tollgate-redis");
    assert!(selects(at(policy, &["spec", "podSelector"]), &redis_pods));
    let rules = policy_rules(policy);
    assert_eq!(rules.len(), 1);
    let (ports, from) = &rules[0];
    assert_eq!(ports, &BTreeSet::from([6379]));
    assert_eq!(from.len(), 1);
    assert!(from[0].get("namespaceSelector").is_none(), "tollgate's namespace only");
    assert!(selects(at(&from[0], &["podSelector"]), &tollgate_pods), "{from:?}");
    assert!(
        !selects(at(&from[0], &["podSelector"]), &redis_pods),
        "not Redis's own pods"
    );
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.as_str().unwrap().to_owned()))
        .collect()
}

/// The Deployment, Service, PodDisruptionBudget and rules ConfigMap against tollgate: ports,
/// environment, mount path, probes (on a running tollgate), rules (tollgate's loader),
/// security context, selectors.
#[test]
fn kubernetes_manifests_match_tollgate() {
    let test = "kubernetes_manifests_match_tollgate";
    let k = kustomization("deploy/kubernetes");
    let docs = manifests(&k.files);
    let namespace = k.namespace.clone().expect("the kustomization sets a namespace");
    assert_eq!(str_at(find(&docs, "Namespace", &namespace), &["kind"]), "Namespace");
    let deployment = find(&docs, "Deployment", "tollgate");
    let pod = at(deployment, &["spec", "template", "spec"]);
    let (c, env) = container(&docs);

    // The image: this version, run as the image runs (entrypoint `tollgate serve`, no args).
    assert_eq!(str_at(c, &["image"]), format!("tollgate:{}", env!("CARGO_PKG_VERSION")));
    assert!(c.get("command").is_none() && c.get("args").is_none());

    // Ports: the settings' (baked-in config/tollgate.yaml plus this environment).
    let settings = settings_with_env(&env);
    let ports: BTreeMap<String, u16> = seq(at(c, &["ports"]))
        .iter()
        .map(|p| {
            (
                str_at(p, &["name"]).to_owned(),
                u16::try_from(at(p, &["containerPort"]).as_u64().unwrap()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        BTreeMap::from([
            (
                "grpc".to_owned(),
                settings.grpc_addr.tcp().expect("a TCP gRPC address").port()
            ),
            ("http".to_owned(), settings.http_addr.port()),
        ])
    );
    assert!(
        settings.admin.addr.ip().is_loopback(),
        "the admin API stays inside the pod"
    );

    // Security: non-root 65534 (the image's USER), read-only root, no privilege, no capability.
    let pod_sc = at(pod, &["securityContext"]);
    assert_eq!(at(pod_sc, &["runAsNonRoot"]).as_bool(), Some(true));
    assert_eq!(at(pod_sc, &["runAsUser"]).as_u64(), Some(65534));
    assert_eq!(at(pod_sc, &["runAsGroup"]).as_u64(), Some(65534));
    assert_eq!(str_at(pod_sc, &["seccompProfile", "type"]), "RuntimeDefault");
    let sc = at(c, &["securityContext"]);
    assert_eq!(at(sc, &["readOnlyRootFilesystem"]).as_bool(), Some(true));
    assert_eq!(at(sc, &["allowPrivilegeEscalation"]).as_bool(), Some(false));
    assert_eq!(strings(at(sc, &["capabilities", "drop"])), ["ALL"]);
    for kind in ["requests", "limits"] {
        assert!(
            at(c, &["resources", kind, "memory"]).as_str().is_some(),
            "resources.{kind}.memory"
        );
    }
    let grace = at(pod, &["terminationGracePeriodSeconds"]).as_u64().unwrap();
    assert!(grace > settings.shutdown.drain_seconds.0 + settings.shutdown.timeout_seconds.0);
    assert!(
        settings.shutdown.drain_seconds.0 >= 5,
        "the drain must outlast the endpoint removal reaching every Envoy: {}s",
        settings.shutdown.drain_seconds.0
    );

    // Secrets: Redis's password from the Secret Redis itself requires; the admin API off unless
    // its token comes from a Secret.
    let secrets = secret_env(&docs, c);
    let mut with_secrets = env.clone();
    for name in secrets.keys() {
        with_secrets.insert(name.clone(), "from-a-secret".into());
    }
    let settings_all = settings_with_env(&with_secrets);
    let redis_c = named_container(&docs, "tollgate-redis", "redis");
    let redis_secrets = secret_env(&docs, redis_c);
    assert_eq!(
        secrets.get("TOLLGATE_REDIS__PASSWORD"),
        redis_secrets.get("REDIS_PASSWORD"),
        "tollgate's Redis password is the one Redis requires"
    );
    assert_eq!(
        redis_secrets.get("REDISCLI_AUTH"),
        redis_secrets.get("REDIS_PASSWORD"),
        "the probes' redis-cli"
    );
    let redis_args = strings(at(redis_c, &["args"]));
    let arg = |flag: &str| {
        let i = redis_args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("redis {flag}"));
        redis_args[i + 1].clone()
    };
    assert_eq!(arg("--requirepass"), "$(REDIS_PASSWORD)");
    // Evicting a bucket refills it (an over-admission): a full Redis must refuse instead.
    assert_eq!(arg("--maxmemory-policy"), "noeviction");
    assert!(!arg("--maxmemory").is_empty());
    let redis_deploy = find(&docs, "Deployment", "tollgate-redis");
    assert_eq!(
        str_at(redis_deploy, &["spec", "strategy", "type"]),
        "Recreate",
        "never two Redis at once"
    );
    assert!(
        !settings_all.admin.enabled || secrets.contains_key("TOLLGATE_ADMIN__TOKEN"),
        "the admin API runs without a token from a Secret"
    );
    assert!(!settings.admin.enabled, "the admin API is off as shipped");

    // The rules: the ConfigMap mounted where the settings' rules path points from the WORKDIR.
    let mounts = seq(at(c, &["volumeMounts"]));
    assert_eq!(mounts.len(), 1);
    assert_eq!(
        Path::new(str_at(&mounts[0], &["mountPath"])),
        Path::new("/srv/tollgate").join(&settings.rules)
    );
    let volume = seq(at(pod, &["volumes"]))
        .iter()
        .find(|v| str_at(v, &["name"]) == str_at(&mounts[0], &["name"]))
        .expect("the mounted volume");
    let (cm_name, cm_files, _) = k.generators.last().expect("a rules ConfigMap generator");
    assert_eq!(str_at(volume, &["configMap", "name"]), cm_name);
    assert!(
        at(volume, &["configMap"]).get("items").is_none(),
        "the whole ConfigMap as a directory (no subPath, no items), so updates reach the pod"
    );
    let rules_dir = tempfile::tempdir().unwrap();
    for f in cm_files {
        fs::copy(repo_path(f), rules_dir.path().join(f.rsplit('/').next().unwrap())).unwrap();
    }
    let set = tollgate::rules::load_rules(rules_dir.path()).unwrap_or_else(|e| panic!("{e}"));
    assert!(!set.is_empty());
    // The example rules, unchanged (the ConfigMap cannot read config/ from outside the
    // kustomization's directory).
    assert_eq!(
        fs::read(repo_path("deploy/kubernetes/rules/example.yaml")).unwrap(),
        fs::read(repo_path("config/rules/example.yaml")).unwrap()
    );

    // The Service: grpc (appProtocol grpc) and http, to the container's named ports.
    let svc = find(&docs, "Service", "tollgate");
    let pod_labels = labels(at(deployment, &["spec", "template", "metadata", "labels"]));
    let selector = labels(at(svc, &["spec", "selector"]));
    assert!(selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)));
    for p in seq(at(svc, &["spec", "ports"])) {
        let name = str_at(p, &["name"]);
        assert_eq!(str_at(p, &["targetPort"]), name, "target the container port by name");
        assert_eq!(at(p, &["port"]).as_u64(), Some(u64::from(ports[name])));
        let expected = if name == "grpc" { "grpc" } else { "http" };
        assert_eq!(str_at(p, &["appProtocol"]), expected);
    }
    // The headless Service (per-pod DNS for Prometheus and Envoys outside the mesh): the same
    // pods and ports, no virtual IP.
    let headless = find(&docs, "Service", "tollgate-headless");
    assert_eq!(str_at(headless, &["spec", "clusterIP"]), "None");
    assert_eq!(labels(at(headless, &["spec", "selector"])), selector);
    assert_eq!(at(headless, &["spec", "ports"]), at(svc, &["spec", "ports"]));
    let pdb = find(&docs, "PodDisruptionBudget", "tollgate");
    let pdb_selector = labels(at(pdb, &["spec", "selector", "matchLabels"]));
    assert!(pdb_selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)));
    let replicas = at(deployment, &["spec", "replicas"]).as_u64().unwrap();
    assert!(replicas >= 2, "a PDB over one replica blocks every drain");

    // Redis: the URL names the Redis Service and its port.
    assert_eq!(settings.backend, Backend::Redis);
    let (host, port, _) = split_url(&settings.redis.urls[0]);
    let redis_svc = find(&docs, "Service", &host);
    assert_eq!(
        at(redis_svc, &["spec", "ports", "0", "port"]).as_u64(),
        Some(u64::from(port))
    );
    let redis_deploy = find(&docs, "Deployment", &host);
    let redis_labels = labels(at(redis_deploy, &["spec", "template", "metadata", "labels"]));
    assert!(labels(at(redis_svc, &["spec", "selector"]))
        .iter()
        .all(|(k, v)| redis_labels.get(k) == Some(v)));

    // The probes: on the http port, paths that answer 200 on tollgate started with this
    // environment and these rules (the shared test Redis standing in for tollgate-redis).
    let probes: Vec<(String, String)> = ["livenessProbe", "readinessProbe"]
        .iter()
        .map(|probe| {
            let get = at(c, &[probe, "httpGet"]);
            assert_eq!(str_at(get, &["port"]), "http", "{probe}");
            (probe.to_string(), str_at(get, &["path"]).to_owned())
        })
        .collect();
    assert_eq!(probes[0].1, "/healthz");
    assert_eq!(probes[1].1, "/readyz");
    let Some(redis_url) = support::redis::shared_redis(test) else {
        return;
    };
    let mut builder = Tollgate::builder().rules_path(rules_dir.path());
    for (k, v) in &env {
        let v = if k == "TOLLGATE_REDIS__URLS" {
            format!("[{redis_url}]")
        } else {
            v.clone()
        };
        builder = builder.env(k, &v);
    }
    let tollgate = builder
        .env("TOLLGATE_REDIS__KEY_PREFIX", &support::redis::unique_prefix(test))
        .start();
    for (probe, path) in probes {
        let answer = http_get(tollgate.http_addr, &path).map(|(status, _)| status);
        assert_eq!(answer, Some(200), "{probe} {path}");
    }
    let line = tollgate.process.log();
    let first = line
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("JSON logs: {line}"));
    serde_json::from_str::<serde_json::Value>(first).expect("a JSON log line");
}

// ---------------------------------------------------------------------------------------------
// Istio

/// The EnvoyFilters of deploy/istio.
fn envoy_filters() -> Vec<Value> {
    let k = kustomization("deploy/istio");
    manifests(&k.files)
        .into_iter()
        .map(|(_, d)| d)
        .filter(|d| str_at(d, &["kind"]) == "EnvoyFilter")
        .collect()
}

/// The Istio set's Gateways.
fn gateways() -> Vec<Value> {
    let k = kustomization("deploy/istio");
    manifests(&k.files)
        .into_iter()
        .map(|(_, d)| d)
        .filter(|d| str_at(d, &["kind"]) == "Gateway")
        .collect()
}

/// The names Istio gives the gateway virtual hosts of `gateways`' servers: `<host>:<port>` for
/// each host of each server (a namespace prefix `ns/` on a host is not part of the name).
fn gateway_vhost_names(gateways: &[Value]) -> Vec<String> {
    let mut names = Vec::new();
    for g in gateways {
        for server in seq(at(g, &["spec", "servers"])) {
            let port = at(server, &["port", "number"]).as_u64().expect("a port number");
            for host in strings(at(server, &["hosts"])) {
                let host = host.rsplit('/').next().unwrap().to_owned();
                names.push(format!("{host}:{port}"));
            }
        }
    }
    names
}

/// The sample Gateway: the pods the EnvoyFilters patch, and a server whose virtual host is the
/// one the VIRTUAL_HOST patch names (Istio names gateway virtual hosts `<host>:<port>`; a patch
/// naming anything else matches nothing and the gateway limits nothing).
#[test]
fn istio_virtual_host_patch_names_a_virtual_host_of_the_gateway() {
    let gateways = gateways();
    assert_eq!(gateways.len(), 1, "the sample Gateway");
    let gateway = &gateways[0];
    assert_eq!(str_at(gateway, &["apiVersion"]), "networking.istio.io/v1");
    assert_eq!(str_at(gateway, &["metadata", "namespace"]), "istio-system");
    let server = at(gateway, &["spec", "servers", "0"]);
    assert_eq!(at(server, &["port", "number"]).as_u64(), Some(80));
    assert_eq!(strings(at(server, &["hosts"])), ["*"]);
    let selector = labels(at(gateway, &["spec", "selector"]));
    for f in envoy_filters() {
        assert_eq!(
            labels(at(&f, &["spec", "workloadSelector", "labels"])),
            selector,
            "{}: the EnvoyFilter patches the Gateway's pods",
            str_at(&f, &["metadata", "name"])
        );
    }
    let names = gateway_vhost_names(&gateways);
    let patched: Vec<String> = patches(&envoy_filters())
        .iter()
        .filter(|(apply, _, _)| apply == "VIRTUAL_HOST")
        .map(|(_, m, _)| str_at(m, &["routeConfiguration", "vhost", "name"]).to_owned())
        .collect();
    assert!(!patched.is_empty());
    for name in patched {
        assert!(
            names.contains(&name),
            "the VIRTUAL_HOST patch matches {name:?}, no virtual host of the Gateway (those are {names:?})"
        );
    }
}

/// Every config patch of the EnvoyFilters: `(applyTo, match, patch)`.
fn patches(filters: &[Value]) -> Vec<(String, Value, Value)> {
    filters
        .iter()
        .flat_map(|f| seq(at(f, &["spec", "configPatches"])).iter())
        .map(|p| {
            (
                str_at(p, &["applyTo"]).to_owned(),
                at(p, &["match"]).clone(),
                at(p, &["patch"]).clone(),
            )
        })
        .collect()
}

/// The rate-limit filter's config (the HTTP_FILTER patch's typed_config).
fn ratelimit_filter(filters: &[Value]) -> Value {
    let inserted: Vec<Value> = patches(filters)
        .into_iter()
        .filter(|(apply, _, _)| apply == "HTTP_FILTER")
        .map(|(_, _, patch)| at(&patch, &["value"]).clone())
        .collect();
    assert_eq!(inserted.len(), 1, "one rate-limit filter");
    assert_eq!(str_at(&inserted[0], &["name"]), "envoy.filters.http.ratelimit");
    at(&inserted[0], &["typed_config"]).clone()
}

/// Every `rate_limits` entry the patches attach (VIRTUAL_HOST and HTTP_ROUTE).
fn rate_limit_entries(filters: &[Value]) -> Vec<Value> {
    let mut entries = Vec::new();
    for (apply, _, patch) in patches(filters) {
        let value = at(&patch, &["value"]);
        match apply.as_str() {
            "VIRTUAL_HOST" => entries.extend(seq(at(value, &["rate_limits"])).iter().cloned()),
            "HTTP_ROUTE" => entries.extend(seq(at(value, &["route", "rate_limits"])).iter().cloned()),
            _ => {}
        }
    }
    assert!(!entries.is_empty(), "no route actions attached");
    entries
}

#[test]
fn istio_envoyfilters_are_well_formed_and_name_the_tollgate_service() {
    let filters = envoy_filters();
    assert_eq!(filters.len(), 2);
    for f in &filters {
        assert_eq!(str_at(f, &["apiVersion"]), "networking.istio.io/v1alpha3");
        assert_eq!(str_at(f, &["metadata", "namespace"]), "istio-system");
        assert_eq!(
            str_at(f, &["spec", "workloadSelector", "labels", "istio"]),
            "ingressgateway"
        );
        for p in seq(at(f, &["spec", "configPatches"])) {
            let keys: BTreeSet<&str> = p.as_mapping().unwrap().keys().map(|k| k.as_str().unwrap()).collect();
            assert_eq!(keys, BTreeSet::from(["applyTo", "match", "patch"]));
            assert_eq!(str_at(p, &["match", "context"]), "GATEWAY");
        }
    }
    for (apply, matched, patch) in patches(&filters) {
        match apply.as_str() {
            "HTTP_FILTER" => {
                assert_eq!(str_at(&patch, &["operation"]), "INSERT_BEFORE");
                let chain = at(&matched, &["listener", "filterChain", "filter"]);
                assert_eq!(
                    str_at(chain, &["name"]),
                    "envoy.filters.network.http_connection_manager"
                );
                assert_eq!(str_at(chain, &["subFilter", "name"]), "envoy.filters.http.router");
            }
            "VIRTUAL_HOST" | "HTTP_ROUTE" => {
                assert_eq!(str_at(&patch, &["operation"]), "MERGE");
                assert!(matched.get("routeConfiguration").is_some());
            }
            other => panic!("unexpected applyTo {other}"),
        }
    }

    // The cluster Istio makes for the tollgate Service's gRPC port, in the Kubernetes set's
    // namespace.
    let config = ratelimit_filter(&filters);
    let k = kustomization("deploy/istio");
    let docs = manifests(&k.files);
    let namespace = k.namespace.expect("a namespace");
    let svc = find(&docs, "Service", "tollgate");
    let grpc = seq(at(svc, &["spec", "ports"]))
        .iter()
        .find(|p| str_at(p, &["name"]) == "grpc")
        .expect("a grpc port");
    let host = format!("tollgate.{namespace}.svc.cluster.local");
    let port = at(grpc, &["port"]).as_u64().unwrap();
    let grpc_service = at(&config, &["rate_limit_service", "grpc_service", "envoy_grpc"]);
    assert_eq!(
        str_at(grpc_service, &["cluster_name"]),
        format!("outbound|{port}||{host}")
    );
    assert_eq!(str_at(grpc_service, &["authority"]), host);
    assert_eq!(str_at(&config, &["rate_limit_service", "transport_api_version"]), "V3");
    assert!(at(&config, &["failure_mode_deny"]).as_bool().is_some());
    assert!(str_at(&config, &["timeout"]).ends_with('s'));
    assert_eq!(str_at(&config, &["enable_x_ratelimit_headers"]), "DRAFT_VERSION_03");
    // The domain is the one of the rules the Istio set ships.
    let (_, files, behavior) = k.generators.last().unwrap();
    assert_eq!(behavior.as_deref(), Some("replace"));
    let dir = rules_dir(files);
    let set = tollgate::rules::load_rules(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let domain = str_at(&config, &["domain"]);
    assert!(set.domain(domain).is_some(), "no rules for domain {domain}");
}

fn rules_dir(files: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in files {
        fs::copy(repo_path(f), dir.path().join(f.rsplit('/').next().unwrap())).unwrap();
    }
    dir
}

/// The rules of `files` with shadow mode switched off, as an operator does once the metrics look
/// right: the tests that drive real Envoy see the limits deny. Panics when no rule was in shadow
/// mode (then this copy would test nothing different).
fn enforcing_rules_dir(files: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut switched = 0;
    for f in files {
        let text = fs::read_to_string(repo_path(f)).unwrap();
        switched += text.matches("shadow_mode: true").count();
        fs::write(
            dir.path().join(f.rsplit('/').next().unwrap()),
            text.replace("shadow_mode: true", "shadow_mode: false"),
        )
        .unwrap();
    }
    assert!(switched > 0, "no rule of {files:?} is in shadow mode");
    dir
}

/// Each descriptor of a rules file (nested ones too) with the keys of the path to it.
fn rule_paths(descriptors: &Value, prefix: &[String], out: &mut Vec<(Vec<String>, Value)>) {
    for d in descriptors.as_sequence().into_iter().flatten() {
        let mut path = prefix.to_vec();
        path.push(str_at(d, &["key"]).to_owned());
        out.push((path.clone(), d.clone()));
        if let Some(children) = d.get("descriptors") {
            rule_paths(children, &path, out);
        }
    }
}

/// The Istio set's rules as shipped: every limit on the client address (which behind a load
/// balancer without trusted proxy hops is the balancer's) and the gateway-wide one count but
/// never deny (`shadow_mode: true`), and the rules still load.
#[test]
fn istio_rules_ship_address_and_gateway_wide_limits_in_shadow_mode() {
    let k = kustomization("deploy/istio");
    let (_, files, _) = k.generators.last().unwrap();
    let mut checked = 0;
    for f in files {
        let rules = yaml(f);
        let mut all = Vec::new();
        rule_paths(at(&rules, &["descriptors"]), &[], &mut all);
        for (path, rule) in all {
            let limited = rule.get("bucket").is_some() || rule.get("token_bucket").is_some();
            let risky = path.iter().any(|k| k == "remote_address" || k == "generic_key");
            if limited && risky {
                checked += 1;
                assert_eq!(
                    rule.get("shadow_mode").and_then(Value::as_bool),
                    Some(true),
                    "{f}: the rule {path:?} limits by client address or all traffic and must ship in shadow mode"
                );
            }
        }
    }
    assert!(checked >= 2, "the per-address and gateway-wide rules: found {checked}");
    let dir = rules_dir(files);
    tollgate::rules::load_rules(dir.path()).unwrap_or_else(|e| panic!("{e}"));
}

/// An Envoy bootstrap like the gateway's: a listener whose HTTP connection manager has the
/// router and the virtual host Istio makes for the sample Gateway's first server (named
/// `<host>:<port>`), with the patches applied the way Istio applies them (a VIRTUAL_HOST patch
/// only to the virtual host of its name), and a cluster of the name the filter asks for.
fn spliced_bootstrap(filters: &[Value], ratelimit_port: u16, upstream_port: u16) -> Value {
    let vhost_name = gateway_vhost_names(&gateways())
        .into_iter()
        .next()
        .expect("a Gateway server");
    let config = ratelimit_filter(filters);
    let cluster = str_at(
        &config,
        &["rate_limit_service", "grpc_service", "envoy_grpc", "cluster_name"],
    )
    .to_owned();
    let bootstrap = format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
    - name: gateway
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: gateway
                # Istio's gateways take the client's address from the connection.
                use_remote_address: true
                route_config:
                  name: http.8080
                  virtual_hosts:
                    - name: {vhost}
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: / }}
                          route: {{ cluster: upstream }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream_port} }} }} }}
    - name: {cluster}
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: {cluster}
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {ratelimit_port} }} }} }}
"#,
        vhost = support::yaml_str(&vhost_name),
        cluster = support::yaml_str(&cluster),
    );
    let mut bootstrap: Value = serde_yaml::from_str(&bootstrap).expect("the bootstrap template");
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    for (apply, matched, patch) in patches(filters) {
        let value = at(&patch, &["value"]).clone();
        match apply.as_str() {
            "HTTP_FILTER" => {
                let router = str_at(&matched, &["listener", "filterChain", "filter", "subFilter", "name"]).to_owned();
                let chain = hcm["http_filters"].as_sequence_mut().unwrap();
                let at_router = chain
                    .iter()
                    .position(|f| f["name"].as_str() == Some(router.as_str()))
                    .expect("the router filter");
                chain.insert(at_router, value);
            }
            "VIRTUAL_HOST" => {
                let vhost = &mut hcm["route_config"]["virtual_hosts"][0];
                let wanted = str_at(&matched, &["routeConfiguration", "vhost", "name"]);
                assert_eq!(
                    vhost["name"].as_str(),
                    Some(wanted),
                    "the VIRTUAL_HOST patch matches no virtual host of the gateway"
                );
                for (k, v) in value.as_mapping().unwrap() {
                    vhost.as_mapping_mut().unwrap().insert(k.clone(), v.clone());
                }
            }
            other => panic!("no splicing for {other}"),
        }
    }
    bootstrap
}

/// The EnvoyFilter patches spliced into a gateway-like bootstrap: Envoy 1.40 accepts the filter
/// config and the route actions (`envoy --mode validate`).
#[test]
fn istio_envoyfilter_patches_validate_in_envoy() {
    let Some(envoy) = envoy_or_skip("istio_envoyfilter_patches_validate_in_envoy") else {
        return;
    };
    let bootstrap = spliced_bootstrap(&envoy_filters(), 8081, 8000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    fs::write(&path, serde_yaml::to_string(&bootstrap).unwrap()).unwrap();
    if let Err(e) = envoy_validate(&envoy, &path) {
        panic!(
            "envoy --mode validate rejects the spliced EnvoyFilter patches:\n{e}\n{}",
            fs::read_to_string(&path).unwrap()
        );
    }
}

/// One descriptor entry an action produces for a sample request: `None` for an action this
/// test does not know (it then fails, so a new action kind gets a rule here).
fn action_entry(action: &Value) -> (String, String) {
    let map = action.as_mapping().unwrap();
    assert_eq!(map.len(), 1, "one action per list item: {action:?}");
    let (kind, body) = map.iter().next().unwrap();
    let key_or = |default: &str| {
        body.get("descriptor_key")
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    match kind.as_str().unwrap() {
        // Envoy's defaults for the key where it is optional.
        "generic_key" => (key_or("generic_key"), str_at(body, &["descriptor_value"]).to_owned()),
        "header_value_match" => (key_or("header_match"), str_at(body, &["descriptor_value"]).to_owned()),
        "remote_address" => ("remote_address".into(), "203.0.113.7".into()),
        "request_headers" => (
            str_at(body, &["descriptor_key"]).to_owned(),
            format!("sample-{}", str_at(body, &["header_name"]).trim_start_matches(':')),
        ),
        "source_cluster" => ("source_cluster".into(), "sample-source".into()),
        "destination_cluster" => ("destination_cluster".into(), "outbound|80||sample".into()),
        other => panic!("action {other}: add what it produces to action_entry"),
    }
}

/// Acceptance 2: every route action's descriptor, sent to tollgate with the Istio set's rules,
/// reaches a bucket (`current_limit` set), and the filter's domain is the one asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_route_actions_reach_buckets_of_the_shipped_rules() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

    let filters = envoy_filters();
    let domain = str_at(&ratelimit_filter(&filters), &["domain"]).to_owned();
    let k = kustomization("deploy/istio");
    let rules = rules_dir(&k.generators.last().unwrap().1);
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().rules_path(rules.path()).start());
    let mut client = RateLimitServiceClient::connect(format!("http://{}", tollgate.grpc_addr))
        .await
        .expect("connect to tollgate");
    let entries = rate_limit_entries(&filters);
    for entry in &entries {
        let descriptor: Vec<(String, String)> = seq(at(entry, &["actions"])).iter().map(action_entry).collect();
        let pairs: Vec<(&str, &str)> = descriptor.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let response = client
            .should_rate_limit(support::request(&domain, &pairs, 0))
            .await
            .unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
            .into_inner();
        assert_eq!(response.overall_code, Code::Ok as i32, "{pairs:?}: {response:?}");
        let status = &response.statuses[0];
        assert!(
            status.current_limit.is_some(),
            "the descriptor {pairs:?} of {entry:?} reaches no bucket of the shipped rules: {response:?}"
        );
    }
    // A descriptor no action makes is unmatched: the check above can tell the difference.
    let response = client
        .should_rate_limit(support::request(&domain, &[("nobody_sends", "this")], 0))
        .await
        .unwrap()
        .into_inner();
    assert!(response.statuses[0].current_limit.is_none(), "{response:?}");
}

/// The spliced gateway bootstrap running: Envoy asks a tollgate holding the Istio rules, and the
/// login limit (5 per client a minute: the `header_value_match` and `remote_address` actions),
/// with shadow mode switched off as the docs tell once the metrics look right, denies the sixth
/// login from one client while other paths still pass. The filter timeout is raised from the
/// EnvoyFilter's 25 ms for a debug build on a busy machine: a late answer would fail open and
/// pass the sixth login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_gateway_patches_limit_logins_through_real_envoy() {
    let Some(envoy_bin) = envoy_or_skip("istio_gateway_patches_limit_logins_through_real_envoy") else {
        return;
    };
    let k = kustomization("deploy/istio");
    let rules = enforcing_rules_dir(&k.generators.last().unwrap().1);
    let tollgate = tokio::task::block_in_place(|| Tollgate::builder().rules_path(rules.path()).start());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|| async { ([("x-upstream", "yes")], "upstream\n") });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let filters = envoy_filters();
    let mut bootstrap = spliced_bootstrap(&filters, tollgate.grpc_addr.port(), upstream.port());
    let chain = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"];
    let filter = chain
        .as_sequence_mut()
        .unwrap()
        .iter_mut()
        .find(|f| f["name"].as_str() == Some("envoy.filters.http.ratelimit"))
        .expect("the spliced rate-limit filter");
    filter["typed_config"]["timeout"] = Value::String("2s".into());
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &serde_yaml::to_string(&bootstrap).unwrap()));
    let base = format!("http://{}", envoy.listener("gateway"));
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .unwrap();
    for n in 1..=5 {
        let reply = client.get(format!("{base}/login")).send().await.unwrap();
        assert_eq!(reply.status(), 200, "login {n}: {:?}", reply.headers());
        assert_eq!(reply.headers()["x-upstream"], "yes");
        // Envoy reports the descriptor with the fewest tokens left: the login bucket.
        assert_eq!(reply.headers()["x-ratelimit-remaining"], (5 - n).to_string().as_str());
    }
    let denied = client.get(format!("{base}/login")).send().await.unwrap();
    assert_eq!(denied.status(), 429, "{:?}", denied.headers());
    assert!(denied.headers().contains_key("retry-after"), "{:?}", denied.headers());
    let other = client.get(format!("{base}/other")).send().await.unwrap();
    assert_eq!(other.status(), 200, "{:?}", other.headers());
    assert!(
        other.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .contains("per_client_ip"),
        "{:?}",
        other.headers()
    );
    tokio::task::block_in_place(|| {
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.over_limit"), 1);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.error"), 0);
    });
}

/// The Postgres variant's tollgate environment on a real tollgate (the shared test server and a
/// schema of its own instead of the `postgres` service): it starts on Postgres, its health check
/// passes, and the `postgres` service's `pg_isready` check answers for a running server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_postgres_environment_serves_and_its_health_checks_pass() {
    let test = "compose_postgres_environment_serves_and_its_health_checks_pass";
    let Some(schema) = support::postgres::TestSchema::new(test).await else {
        return;
    };
    let merged = compose_postgres();
    let mut env = compose_env(service(&merged, "tollgate"));
    assert!(env.contains_key("TOLLGATE_POSTGRES__URL"));
    // The test server's URL carries what it needs; the demo's password is for the demo's server.
    env.insert("TOLLGATE_POSTGRES__URL".into(), schema.url.clone());
    env.remove("TOLLGATE_POSTGRES__PASSWORD");
    env.insert("TOLLGATE_POSTGRES__SCHEMA".into(), schema.name.clone());
    let mut builder = Tollgate::builder().rules_path(repo_path("config/rules"));
    for (k, v) in &env {
        builder = builder.env(k, v);
    }
    let tollgate = tokio::task::block_in_place(|| builder.start());
    let check = healthcheck(service(&merged, "tollgate"));
    let out = probe(&check[2], tollgate.http_addr.port());
    assert!(out.status.success(), "{out:?}\n{}", tollgate.process.log_tail(20));
    let config: serde_json::Value = serde_json::from_str(&tollgate.config().expect("/config").1).expect("/config JSON");
    assert_eq!(config["settings"]["backend"], "postgres");
    assert_eq!(config["settings"]["postgres"]["schema"], schema.name.as_str());

    // pg_isready as the postgres service runs it, pointed at the test server.
    let (host, port, _) = split_url(&schema.url);
    let mut args = healthcheck(service(&merged, "postgres"));
    let program = args.remove(0);
    let h = args.iter().position(|a| a == "-h").expect("pg_isready -h");
    assert_eq!(args[h + 1], "127.0.0.1", "inside the container, loopback");
    args[h + 1] = host;
    args.extend(["-p".to_owned(), port.to_string()]);
    let out = Command::new(program).args(&args).output().expect("run pg_isready");
    assert!(out.status.success(), "{out:?}");
    drop(tollgate);
    schema.drop().await;
}

/// `tollgate probe`, the health check of the image and compose: 0 on 2xx; 1 naming the status,
/// the refused connection or the timeout.
#[test]
fn probe_exits_1_with_the_reason_unless_2xx() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("probe")
            .args(args)
            .output()
            .expect("run tollgate probe");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let tollgate = Tollgate::start(&[]);
    let ok = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["probe", &format!("http://{}/healthz", tollgate.http_addr)])
        .output()
        .unwrap();
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
    let (code, err) = run(&[&format!("http://{}/nowhere", tollgate.http_addr)]);
    assert_eq!(code, Some(1));
    assert!(err.contains("404"), "{err}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let (code, err) = run(&[&format!("http://{closed_addr}/readyz")]);
    assert_eq!(code, Some(1));
    assert!(err.contains("refused"), "{err}");

    // Accepts the connection and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let started = std::time::Instant::now();
    let (code, err) = run(&["--timeout-ms", "300", &format!("http://{silent_addr}/readyz")]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no answer within 300 ms"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    drop(silent);

    let (code, err) = run(&["not a url"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("not a usable URL"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// scripts/ensure-tools

/// Writes an executable shell script.
fn write_script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// `scripts/ensure-tools` in a home of its own, with its tools directory first on PATH (as a
/// developer may have it): the machine's promtool and kubectl are linked, not the links
/// themselves (a link to itself is a loop), a second run leaves correct links alone, and a cached
/// Python tool of another version than the script pins is reinstalled at the pin. The virtualenv
/// and the machine's tools are stand-ins (shell scripts answering `--version`, and a `python`
/// answering `pip show` from a state directory and recording `pip install`), so nothing is
/// downloaded.
#[test]
fn ensure_tools_links_the_machines_tools_and_enforces_the_pins() {
    let script = repo_path("scripts/ensure-tools");
    let text = fs::read_to_string(&script).unwrap();
    let pins_line = text
        .lines()
        .find(|l| l.starts_with("pip_tools=("))
        .expect("the pinned pip tools");
    let pins: Vec<(String, String)> = pins_line
        .split('"')
        .filter(|w| w.contains("=="))
        .map(|w| {
            let (name, version) = w.split_once("==").unwrap();
            (name.to_owned(), version.to_owned())
        })
        .collect();
    assert_eq!(pins.len(), 2, "{pins_line}");

    let home = tempfile::tempdir().unwrap();
    let root = home.path().join(".cache/tollgate/tools");
    let bin = root.join("bin");
    let venv = root.join("venv/bin");
    let state = root.join("venv/state");
    fs::create_dir_all(&state).unwrap();
    write_script(
        &venv.join("python"),
        r#"state="$(dirname "$0")/../state"
if [ "$1 $2 $3" = "-m pip show" ]; then
  [ -f "$state/$4" ] || exit 1
  echo "Name: $4"; echo "Version: $(cat "$state/$4")"; exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  shift 3
  for a in "$@"; do
    case "$a" in --*) ;; *) echo "$a" >> "$state/installed.log"; echo "${a##*==}" > "$state/${a%%==*}";; esac
  done
  exit 0
fi
exit 2
"#,
    );
    for tool in ["hadolint", "kubernetes-validate"] {
        write_script(&venv.join(tool), "echo 1.0\n");
    }
    // The first pin cached at another version, the second at its own.
    fs::write(state.join(&pins[0].0), "0.0.1\n").unwrap();
    fs::write(state.join(&pins[1].0), format!("{}\n", pins[1].1)).unwrap();
    let machine = home.path().join("machine-bin");
    for tool in ["promtool", "kubectl"] {
        write_script(&machine.join(tool), "echo 1.0\n");
    }
    let path = format!("{}:{}:/usr/bin:/bin", bin.display(), machine.display());
    let run = || {
        let out = Command::new("bash")
            .arg(&script)
            .env("HOME", home.path())
            .env("PATH", &path)
            .output()
            .expect("run scripts/ensure-tools");
        assert!(
            out.status.success(),
            "scripts/ensure-tools: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().last(),
            Some(bin.to_str().unwrap()),
            "the tools directory, last"
        );
    };
    let resolved = |tool: &str| fs::canonicalize(bin.join(tool)).unwrap_or_else(|e| panic!("{tool}: {e}"));
    let inode = |tool: &str| {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(bin.join(tool)).unwrap().ino()
    };
    run();
    let installed = fs::read_to_string(state.join("installed.log")).unwrap_or_default();
    assert_eq!(
        installed.lines().collect::<Vec<_>>(),
        [format!("{}=={}", pins[0].0, pins[0].1)],
        "only the tool off its pin is reinstalled, at the pin"
    );
    let before: Vec<u64> = ["hadolint", "kubernetes-validate", "promtool", "kubectl"]
        .iter()
        .map(|t| inode(t))
        .collect();
    // Now every link is on PATH (first): a lookup that finds them would link them to themselves.
    run();
    for tool in ["promtool", "kubectl"] {
        assert_eq!(resolved(tool), fs::canonicalize(machine.join(tool)).unwrap(), "{tool}");
    }
    for tool in ["hadolint", "kubernetes-validate"] {
        assert_eq!(resolved(tool), fs::canonicalize(venv.join(tool)).unwrap(), "{tool}");
    }
    let after: Vec<u64> = ["hadolint", "kubernetes-validate", "promtool", "kubectl"]
        .iter()
        .map(|t| inode(t))
        .collect();
    assert_eq!(before, after, "correct links are left alone");
    assert_eq!(
        fs::read_to_string(state.join("installed.log")).unwrap().lines().count(),
        1,
        "nothing reinstalled once on the pins"
    );
}

/// `/readyz` of `tollgate`, polled until it answers 200 or `wait` passes: the status last seen.
fn readyz_within(tollgate: &Tollgate, wait: std::time::Duration) -> Option<u16> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let status = http_get(tollgate.http_addr, "/readyz").map(|(s, _)| s);
        if status == Some(200) || std::time::Instant::now() > deadline {
            return status;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// redis.yaml's Redis as its container runs it: a real `redis-server` with the manifest's args
/// (the password of the Secret in place of `$(REDIS_PASSWORD)`, as the kubelet expands it) on a
/// free loopback port. Its probes' `redis-cli ping` answers with `REDISCLI_AUTH`, the memory
/// policy is `noeviction`, and tollgate with the Deployment's environment and that password gets
/// ready, while without the password it stays not ready.
#[test]
fn kubernetes_redis_runs_with_the_manifest_args_and_tollgate_logs_in() {
    let k = kustomization("deploy/kubernetes");
    let docs = manifests(&k.files);
    let redis_c = named_container(&docs, "tollgate-redis", "redis");
    let (secret, key) = secret_env(&docs, redis_c)["REDIS_PASSWORD"].clone();
    let password = str_at(find(&docs, "Secret", &secret), &["stringData", &key]).to_owned();
    let port = support::free_port();
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = strings(at(redis_c, &["args"]))
        .into_iter()
        .map(|a| a.replace("$(REDIS_PASSWORD)", &password))
        .collect();
    args.extend(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"].map(str::to_owned));
    args.push(dir.path().to_string_lossy().into_owned());
    let mut redis = support::ChildGuard::spawn(
        "redis-server",
        Command::new("redis-server").args(&args),
        &dir.path().join("redis.log"),
    );
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    support::wait_until(&mut redis, || {
        support::redis::resp_command(addr, Some(&password), &[b"PING"]).ok()
    })
    .unwrap_or_else(|e| panic!("redis-server {args:?}: {e}"));

    // The probes, as the container runs them.
    let probe = strings(at(redis_c, &["readinessProbe", "exec", "command"]));
    assert_eq!(probe, ["redis-cli", "ping"]);
    assert_eq!(support::redis::redis_cli(port, Some(&password), &["ping"]), "PONG");
    assert_eq!(
        support::redis::redis_cli(port, Some(&password), &["config", "get", "maxmemory-policy"]),
        "maxmemory-policy\nnoeviction"
    );
    let unauthenticated = support::redis::resp_command(addr, None, &[b"SET", b"k", b"v"]).and_then(|v| v.ok());
    assert!(
        unauthenticated.is_err(),
        "Redis answers without the password: {unauthenticated:?}"
    );

    let (_, env) = container(&docs);
    let start = |with_password: bool| {
        let mut builder = Tollgate::builder().rules_path(repo_path("deploy/kubernetes/rules"));
        for (k, v) in &env {
            let v = if k == "TOLLGATE_REDIS__URLS" {
                format!("[redis://127.0.0.1:{port}]")
            } else {
                v.clone()
            };
            builder = builder.env(k, &v);
        }
        if with_password {
            builder = builder.env("TOLLGATE_REDIS__PASSWORD", &password);
        }
        builder.start()
    };
    let tollgate = start(true);
    let status = readyz_within(&tollgate, std::time::Duration::from_secs(10));
    assert_eq!(status, Some(200), "{}", tollgate.process.log_tail(20));
    drop(tollgate);
    let locked_out = start(false);
    let status = readyz_within(&locked_out, std::time::Duration::from_secs(2));
    assert_ne!(
        status,
        Some(200),
        "ready without Redis's password: the password check proves nothing"
    );
}

/// `docker-compose.tracing.yml` over `docker-compose.yml`: Envoy runs `envoy/tracing.yaml` (the
/// bootstrap `tests/suite/traces.rs` runs), and tollgate's OTLP endpoint is the collector
/// address that bootstrap sends Envoy's spans to, a Jaeger in the same network namespace.
#[test]
fn compose_tracing_override_joins_envoy_and_tollgate_at_one_collector() {
    let merged = compose_merge(&compose(), &yaml("docker-compose.tracing.yml"));
    let envoy = service(&merged, "envoy");
    let mounts = bind_mounts(envoy);
    assert_eq!(
        mounts,
        [("./envoy/tracing.yaml".to_owned(), "/etc/envoy/envoy.yaml".to_owned())]
    );
    let bootstrap = yaml("envoy/tracing.yaml");
    let collector = seq(at(&bootstrap, &["static_resources", "clusters"]))
        .iter()
        .find(|c| str_at(c, &["name"]) == "otel_collector")
        .expect("an otel_collector cluster");
    let socket = at(
        collector,
        &[
            "load_assignment",
            "endpoints",
            "0",
            "lb_endpoints",
            "0",
            "endpoint",
            "address",
            "socket_address",
        ],
    );
    let envoy_sends_to = format!(
        "http://{}:{}",
        str_at(socket, &["address"]),
        at(socket, &["port_value"]).as_u64().unwrap()
    );
    let env = compose_env(service(&merged, "tollgate"));
    assert_eq!(env.get("OTEL_EXPORTER_OTLP_ENDPOINT"), Some(&envoy_sends_to));
    // The rest of tollgate's environment is the base file's, and still loads.
    settings_with_env(
        &env.iter()
            .filter(|(k, _)| k.starts_with("TOLLGATE_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    );
    let jaeger = service(&merged, "jaeger");
    assert_eq!(str_at(jaeger, &["network_mode"]), "service:tollgate");
    assert!(str_at(jaeger, &["image"]).starts_with("jaegertracing/jaeger:"));
    assert!(strings(at(service(&merged, "tollgate"), &["ports"]))
        .iter()
        .any(|p| p == "127.0.0.1:16686:16686"));
}
