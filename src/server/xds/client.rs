//! The aggregated discovery stream (state of the world) that brings the rules: connect, send
//! the subscription, ACK or NACK each response, and open the stream again after a backoff when
//! it fails, resuming from the version in force.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{node::UserAgentVersionType, Node};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tonic::metadata::{MetadataKey, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::map::{compile_resources, TYPE_URL};
use super::{Failure, XdsState};
use crate::core::units::Millis;
use crate::decision::limiter::Limiter;
use crate::server::reload::{count_rejected, domain_list, put_in_force};
use crate::server::settings::xds::{ServerUrl, XdsBackoffSettings, XdsTlsSettings};
use crate::server::settings::XdsSettings;
use crate::store::Store;

/// `google.rpc.Code.INVALID_ARGUMENT`, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;
/// The longest `error_detail` message sent; the log has every problem.
const MAX_DETAIL_BYTES: usize = 8 * 1024;
/// A stream that stayed open this long was healthy: after it, the backoff starts over.
const HEALTHY_STREAM: Duration = Duration::from_secs(30);
/// The longest pause before a repeated NACK. go-control-plane sends nothing newer until it has
/// an answer to its latest response, so a pause also delays a fixed snapshot: it stays short.
const MAX_NACK_PAUSE: Duration = Duration::from_secs(5);
/// HTTP/2 PINGs on the connection, so a server that vanished is noticed while the stream
/// waits for a response (a resumed stream may wait for hours). Not more often: a gRPC-Go
/// server (go-control-plane, Envoy Gateway's rate-limit xDS server among them) by default
/// closes a connection whose client pings more than once in 5 minutes ("too_many_pings").
const KEEPALIVE: Duration = Duration::from_secs(330);
/// TCP keep-alive on the socket, which the server does not count: a peer gone without a word
/// (a node lost) is noticed by the kernel's probes within about a minute and a half (idle a
/// minute, then three probes 10 s apart).
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// How long a PING may go unanswered.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The capped exponential backoff with jitter of `xds.backoff`.
#[derive(Debug)]
pub(super) struct Backoff {
    settings: XdsBackoffSettings,
    /// Failures in a row so far.
    attempt: u32,
    rng: rand::rngs::SmallRng,
}

impl Backoff {
    /// A backoff by `settings`, its randomness seeded with `seed`.
    pub(super) fn new(settings: XdsBackoffSettings, seed: u64) -> Backoff {
        Backoff {
            settings,
            attempt: 0,
            rng: rand::rngs::SmallRng::seed_from_u64(seed),
        }
    }

    /// The wait before the next attempt: `initial_ms` doubled once per failure in a row before
    /// this one, at most `max_ms`, less a random share of up to `jitter` of it.
    pub(super) fn next_wait(&mut self) -> Duration {
        let initial = self.settings.initial_ms.duration();
        let max = self.settings.max_ms.duration().max(initial);
        let full = initial.saturating_mul(1u32 << self.attempt.min(20)).min(max);
        self.attempt = self.attempt.saturating_add(1);
        let cut = self.settings.jitter.clamp(0.0, 1.0) * self.rng.random::<f64>();
        full.mul_f64(1.0 - cut)
    }

    /// Starts over after a healthy stream.
    pub(super) fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// Runs the client until its task is aborted: stream, and after each failure wait and stream
/// again.
pub(super) async fn run<S: Store>(settings: XdsSettings, limiter: Arc<Limiter<S>>, state: Arc<XdsState>) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(32);
    let mut backoff = Backoff::new(settings.backoff, seed);
    let mut stream = Stream {
        node: node(&settings),
        pacing: Backoff::new(
            XdsBackoffSettings {
                max_ms: Millis(settings.backoff.max_ms.0.min(MAX_NACK_PAUSE.as_millis() as u64)),
                ..settings.backoff
            },
            seed.rotate_left(17),
        ),
        settings,
        limiter,
        state,
        in_force: None,
        refused: None,
        foreign_seen: std::collections::BTreeSet::new(),
    };
    loop {
        let started = Instant::now();
        let ended = stream.once().await;
        // A server that answers every stream with something refused, or drops each soon after
        // it opens, is not healthy: only an ACK or a stream that stayed up starts over.
        if ended.acked || started.elapsed() >= HEALTHY_STREAM {
            backoff.reset();
        }
        let wait = backoff.next_wait();
        stream.state.failed(ended.error, ended.failure, wait);
        tokio::time::sleep(wait).await;
    }
}

/// Builds what connecting takes (TLS files read and parsed), without connecting: `serve` calls
/// it at start, so a missing or bad certificate stops it at once, naming the file.
///
/// Errors: the server URL, or a TLS file that cannot be read or parsed.
pub(super) fn endpoint(settings: &XdsSettings) -> Result<Endpoint, String> {
    let url = ServerUrl::parse(&settings.server_url).map_err(|why| format!("xds.server_url: {why}"))?;
    let scheme = if settings.tls.enabled { "https" } else { "http" };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{}:{}", url.host, url.port))
        .map_err(|e| format!("xds.server_url: {}", crate::error_chain(&e)))?
        .connect_timeout(settings.connect_timeout_ms.duration())
        .tcp_nodelay(true)
        .tcp_keepalive(Some(TCP_KEEPALIVE))
        .tcp_keepalive_interval(Some(Duration::from_secs(10)))
        .tcp_keepalive_retries(Some(3))
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    if !settings.tls.enabled {
        return Ok(endpoint);
    }
    let tls = tls_config(&settings.tls, settings.connect_timeout_ms.duration())?;
    endpoint
        .tls_config(tls)
        .map_err(|e| format!("xds.tls: {}", crate::error_chain(&e)))
}

/// The TLS of `tls`: the client certificate, the CA (or the system's roots), the SAN. The files
/// are read at each connection, so certificates renewed on disk are used from the next one.
fn tls_config(tls: &XdsTlsSettings, timeout: Duration) -> Result<ClientTlsConfig, String> {
    let read = |setting: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("xds.tls.{setting} {}: {e}", path.display()))
    };
    let mut config = ClientTlsConfig::new().timeout(timeout);
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        config = config.identity(Identity::from_pem(read("cert_file", cert)?, read("key_file", key)?));
    }
    config = match &tls.ca_file {
        Some(ca) => config.ca_certificate(Certificate::from_pem(read("ca_file", ca)?)),
        None => config.with_native_roots(),
    };
    if let Some(san) = &tls.san {
        config = config.domain_name(san.clone());
    }
    Ok(config)
}

/// The node tollgate subscribes as: `xds.node_id`, `xds.node_metadata` as string fields, and
/// tollgate's name and version as the user agent.
fn node(settings: &XdsSettings) -> Node {
    let fields = settings
        .node_metadata
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                Value {
                    kind: Some(Kind::StringValue(v.clone())),
                },
            )
        })
        .collect();
    Node {
        id: settings.node_id.clone(),
        metadata: Some(Struct { fields }),
        user_agent_name: "tollgate".into(),
        user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(env!("CARGO_PKG_VERSION").into())),
        ..Default::default()
    }
}

/// A request of the stream: the subscription (every `RateLimitConfig`: no resource names),
/// carrying `version` (the rules in force), the `nonce` answered, and why a NACK refused it.
fn request(node: &Node, version: String, nonce: String, error: Option<String>) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version,
        node: Some(node.clone()),
        type_url: TYPE_URL.into(),
        response_nonce: nonce,
        error_detail: error.map(|message| RpcStatus {
            code: INVALID_ARGUMENT,
            message,
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

/// How one stream ended.
struct Ended {
    /// Why (for the log and `/config`).
    error: String,
    /// What kind of failure (for `/readyz`).
    failure: Failure,
    /// Whether an update was ACKed on it.
    acked: bool,
}

/// What to do with a response.
enum Answer {
    /// Send this ACK or NACK now.
    Now(DiscoveryRequest),
    /// Send this repeated NACK after a pause, unless a newer response of the rules comes first.
    After(Duration, Repeat),
    /// Nothing: a response of a type not subscribed to.
    Ignore,
}

/// A repeated NACK waiting for its pause: recorded as a NACK only once sent.
struct Repeat {
    request: DiscoveryRequest,
    version: String,
    problems: Vec<String>,
}

/// A snapshot refused: its resources, sorted, and why.
struct Refused {
    print: Vec<Any>,
    problems: Vec<String>,
}

/// One stream's worth of the client, and what outlives it.
struct Stream<S> {
    settings: XdsSettings,
    node: Node,
    limiter: Arc<Limiter<S>>,
    state: Arc<XdsState>,
    /// The resources of the snapshot in force, sorted: one identical to it is ACKed without a
    /// swap (each swap makes the memory store keep its buckets that are not full).
    in_force: Option<Vec<Any>>,
    /// The last snapshot refused. A control plane that resends its snapshot at once on a NACK
    /// (go-control-plane does, while the versions differ) would otherwise have it compiled,
    /// logged and refused as fast as the network allows: the same one is refused again
    /// without compiling, after `pacing`.
    refused: Option<Refused>,
    /// The pauses before repeated NACKs: `xds.backoff` up to [`MAX_NACK_PAUSE`], started over
    /// by an ACK.
    pacing: Backoff,
    /// The types of responses ignored so far (each warned about once).
    foreign_seen: std::collections::BTreeSet<String>,
}

impl<S: Store> Stream<S> {
    /// Connects, opens the stream and answers its responses until it fails.
    async fn once(&mut self) -> Ended {
        let channel = match self.connect().await {
            Ok(channel) => channel,
            Err(error) => {
                return Ended {
                    error,
                    failure: Failure::Connect,
                    acked: false,
                }
            }
        };
        self.state.set_connected(true);
        tracing::info!(server = %self.settings.server_url, node = %self.settings.node_id, "connected to the xDS server");
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(request(&self.node, self.state.version(), String::new(), None));
        let requests = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        let mut call = tonic::Request::new(requests);
        for (name, value) in &self.settings.headers {
            // Checked with the settings; a header that still does not fit is left out.
            if let (Ok(name), Ok(value)) = (MetadataKey::from_bytes(name.as_bytes()), MetadataValue::try_from(value)) {
                call.metadata_mut().insert(name, value);
            }
        }
        let mut client =
            AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(self.settings.max_message_bytes);
        let mut responses = match client.stream_aggregated_resources(call).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                let (error, failure) = self.stream_failure(&status);
                return Ended {
                    error,
                    failure,
                    acked: false,
                };
            }
        };
        let mut acked = false;
        // A repeated NACK waits here; a newer response of the rules supersedes it (the server
        // only hears the answer to its latest nonce).
        let mut pending: Option<(tokio::time::Instant, Repeat)> = None;
        loop {
            let next = match &pending {
                Some((at, _)) => tokio::select! {
                    // A response ready with the timer wins: it may supersede the NACK.
                    biased;
                    // Cancel-safe: a message half read stays buffered in the stream.
                    next = responses.message() => next,
                    () = tokio::time::sleep_until(*at) => {
                        let Some((_, repeat)) = pending.take() else { continue };
                        self.state.nacked(&repeat.version, repeat.problems);
                        if tx.send(repeat.request).is_ok() {
                            continue;
                        }
                        return Ended { error: "the stream's requests ended".to_owned(), failure: Failure::Stream, acked };
                    }
                },
                None => responses.message().await,
            };
            let error = match next {
                Ok(Some(response)) => {
                    let request = match self.answer(response).await {
                        Answer::Now(request) => request,
                        Answer::After(wait, repeat) => {
                            pending = Some((tokio::time::Instant::now() + wait, repeat));
                            continue;
                        }
                        Answer::Ignore => continue,
                    };
                    pending = None;
                    acked |= request.error_detail.is_none();
                    if tx.send(request).is_ok() {
                        continue;
                    }
                    ("the stream's requests ended".to_owned(), Failure::Stream)
                }
                Ok(None) => ("the server closed the stream".to_owned(), Failure::Stream),
                Err(status) => self.stream_failure(&status),
            };
            let (error, failure) = error;
            return Ended { error, failure, acked };
        }
    }

    /// What a failed stream's `status` says, and its kind: a response over
    /// `xds.max_message_bytes` is told apart, since retrying cannot help until a setting or the
    /// server's rules change.
    fn stream_failure(&self, status: &tonic::Status) -> (String, Failure) {
        let text = status_text(status);
        if status.code() == tonic::Code::OutOfRange && status.message().contains("message length too large") {
            let max = self.settings.max_message_bytes;
            let error = format!("a response larger than xds.max_message_bytes ({max} bytes) was refused: {text}");
            return (error, Failure::TooLarge);
        }
        (text, Failure::Stream)
    }

    /// A connected channel to the server.
    async fn connect(&self) -> Result<Channel, String> {
        let endpoint = endpoint(&self.settings)?;
        endpoint
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {}", crate::error_chain(&e)))
    }

    /// Applies one response, or refuses it: the ACK or NACK to send.
    async fn answer(&mut self, response: DiscoveryResponse) -> Answer {
        let DiscoveryResponse {
            version_info: version,
            resources,
            type_url,
            nonce,
            ..
        } = response;
        if type_url != TYPE_URL {
            self.foreign(&type_url, &version);
            return Answer::Ignore;
        }
        let mut print = resources.clone();
        print.sort_by(|a, b| (&a.type_url, &a.value).cmp(&(&b.type_url, &b.value)));
        if self.in_force.as_ref() == Some(&print) {
            self.accepted(&version);
            tracing::info!(version = %version, "xDS update: the same rules as in force; acknowledged, nothing swapped");
            return Answer::Now(request(&self.node, version, nonce, None));
        }
        if let Some(refused) = self.refused.as_ref().filter(|r| r.print == print) {
            let problems = refused.problems.clone();
            let wait = self.pacing.next_wait();
            tracing::debug!(version = %version, wait = ?wait, "xDS update: the snapshot refused before, sent again; refused again");
            let request = self.nack_request(nonce, &problems);
            return Answer::After(
                wait,
                Repeat {
                    request,
                    version,
                    problems,
                },
            );
        }
        let limiter = self.limiter.clone();
        // Compiling and swapping run on the blocking pool, as a file reload does.
        let applied = tokio::task::spawn_blocking(move || {
            let current = limiter.rules().generation;
            match compile_resources(&resources) {
                Ok(rules) => {
                    let domains = domain_list(&rules);
                    Ok((put_in_force(&limiter, rules), domains))
                }
                Err(errors) => Err(count_rejected(&errors, current)),
            }
        })
        .await;
        let problems = match applied {
            Ok(Ok((generation, domains))) => {
                self.in_force = Some(print);
                self.accepted(&version);
                tracing::info!(
                    server = %self.settings.server_url,
                    version = %version,
                    generation,
                    domains = %domains,
                    "rules from the xDS server in force; acknowledged"
                );
                return Answer::Now(request(&self.node, version, nonce, None));
            }
            Ok(Err(problems)) => problems,
            Err(e) => vec![format!("xds: the update was not applied: {e}")],
        };
        self.refused = Some(Refused {
            print,
            problems: problems.clone(),
        });
        self.pacing.reset();
        tracing::error!(
            server = %self.settings.server_url,
            version = %version,
            problems = problems.len(),
            in_force = %self.state.version(),
            "rules from the xDS server rejected; the previous rules stay in force"
        );
        let request = self.nack_request(nonce, &problems);
        self.state.nacked(&version, problems);
        Answer::Now(request)
    }

    /// Records an ACK: the rules of `version` are in force (new, or the same as before), so a
    /// failure of an earlier update no longer stands.
    fn accepted(&mut self, version: &str) {
        self.state.acked(version);
        self.refused = None;
        self.pacing.reset();
        crate::telemetry::reload_failure_cleared();
    }

    /// Logs a response of a type tollgate did not subscribe to, which is not answered, as
    /// Envoy does not answer one: a request of that type would subscribe to it (no resource
    /// names means all of them), and a NACK's empty version would have a server send it again
    /// at once. The rules and their state are untouched.
    fn foreign(&mut self, type_url: &str, version: &str) {
        if self.foreign_seen.insert(type_url.to_owned()) {
            tracing::warn!(
                server = %self.settings.server_url,
                type_url,
                version,
                "xDS response of a type not subscribed to; ignored (the rules in force stay)"
            );
        } else {
            tracing::debug!(type_url, version, "xDS response of a type not subscribed to; ignored");
        }
    }

    /// The NACK (nonce `nonce`) of `problems`: the version in force, and `error_detail`.
    fn nack_request(&self, nonce: String, problems: &[String]) -> DiscoveryRequest {
        let mut detail = problems.join("\n");
        if detail.len() > MAX_DETAIL_BYTES {
            let mut cut = MAX_DETAIL_BYTES;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push_str("\n... (more in tollgate's log)");
        }
        request(&self.node, self.state.version(), nonce, Some(detail))
    }
}

/// A gRPC status in words: its code, its message, and what caused it (a TLS alert, say,
/// behind tonic's "transport error").
fn status_text(status: &tonic::Status) -> String {
    let message = status.message();
    let detail = match std::error::Error::source(status).map(crate::error_chain) {
        Some(cause) if cause.starts_with(message) => cause,
        Some(cause) => format!("{message}: {cause}"),
        None => message.to_owned(),
    };
    format!("the stream failed: {:?}: {detail}", status.code())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::units::Millis;

    #[test]
    fn backoff_doubles_up_to_the_cap_jitter_only_shortens_and_reset_starts_over() {
        let settings = XdsBackoffSettings {
            initial_ms: Millis(100),
            max_ms: Millis(1_000),
            jitter: 0.0,
        };
        let mut b = Backoff::new(settings, 7);
        let waits: Vec<u128> = (0..7).map(|_| b.next_wait().as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000, 1000]);
        b.reset();
        assert_eq!(b.next_wait().as_millis(), 100);
        let mut b = Backoff::new(
            XdsBackoffSettings {
                jitter: 0.5,
                ..settings
            },
            7,
        );
        let mut seen = std::collections::BTreeSet::new();
        for attempt in 0..200 {
            let full = (100u128 << attempt.min(4)).min(1_000);
            let wait = b.next_wait().as_millis();
            assert!(wait <= full && wait * 2 >= full, "attempt {attempt}: {wait} of {full}");
            seen.insert(wait);
        }
        assert!(seen.len() > 50, "the jitter varies the waits: {seen:?}");
        // A long run of failures never overflows.
        let mut b = Backoff::new(
            XdsBackoffSettings {
                jitter: 0.0,
                ..settings
            },
            1,
        );
        assert_eq!(
            (0..100).map(|_| b.next_wait()).last(),
            Some(Duration::from_millis(1_000))
        );
    }

    #[test]
    fn requests_subscribe_ack_and_nack() {
        let settings = XdsSettings {
            node_id: "envoy-ratelimit".into(),
            node_metadata: [("zone".to_owned(), "a".to_owned())].into(),
            ..XdsSettings::default()
        };
        let node = node(&settings);
        let first = request(&node, String::new(), String::new(), None);
        assert_eq!(first.type_url, TYPE_URL);
        assert!(first.resource_names.is_empty(), "every RateLimitConfig");
        assert_eq!(first.node.as_ref().map(|n| n.id.as_str()), Some("envoy-ratelimit"));
        let meta = &first.node.as_ref().unwrap().metadata.as_ref().unwrap().fields["zone"];
        assert_eq!(meta.kind, Some(Kind::StringValue("a".into())));
        let nack = request(&node, "v1".into(), "n2".into(), Some("xds:a: rule `k`: bad".into()));
        assert_eq!((nack.version_info.as_str(), nack.response_nonce.as_str()), ("v1", "n2"));
        let detail = nack.error_detail.unwrap();
        assert_eq!(detail.code, INVALID_ARGUMENT);
        assert_eq!(detail.message, "xds:a: rule `k`: bad");
    }

    #[test]
    fn tls_files_are_read_at_start_naming_a_missing_one() {
        let mut settings = XdsSettings::default();
        assert!(endpoint(&settings).is_ok());
        settings.tls.enabled = true;
        settings.tls.ca_file = Some("/nonexistent/ca.crt".into());
        let err = endpoint(&settings).unwrap_err();
        assert!(err.contains("xds.tls.ca_file /nonexistent/ca.crt"), "{err}");
    }
}
