//! TLS on tollgate's own listeners (docs/operations.md, "TLS"): the gRPC, HTTP and admin
//! listeners each serve TLS when their `tls` entry is set, verify client certificates against a
//! CA (mTLS) when it names one, and take a rotated certificate, key or CA from disk for new
//! connections without touching open ones.
//!
//! - `settings.rs`: the `tls` section and the problems it can have without reading a file.
//! - `material.rs`: the PEM files read into what rustls serves (the certificate chain and key,
//!   the client verifier with its subject-alternative-name check) and what is shown of the
//!   certificate (subject, serial, expiry).
//! - `reload.rs`: each listener's material in an `ArcSwap` that rustls reads at every
//!   handshake, and the check that swaps in changed files.
//! - `accept.rs`: a TCP listener whose connections come out after their handshake, for tonic
//!   and axum.
//!
//! Session resumption is off: every connection is a full handshake, verified against the
//! files in use when it opens (Envoy keeps its connections, so this costs next to nothing).

pub(crate) mod accept;
pub(crate) mod material;
pub(crate) mod reload;
mod settings;

pub use settings::{ListenerTls, TlsSettings};

use std::sync::Arc;
use std::time::Duration;

use rustls::server::{NoServerSessionStorage, ServerConfig};
use serde_json::Value;

use crate::server::tls::accept::Acceptor;
use crate::server::tls::reload::{Checked, CurrentCert, CurrentVerifier, Reloading};

/// The listeners TLS can be on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listener {
    /// `grpc_addr`: HTTP/2 only.
    Grpc,
    /// `http_addr`.
    Http,
    /// `admin.addr`.
    Admin,
}

impl Listener {
    /// Its name in settings, metrics and logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Listener::Grpc => "grpc",
            Listener::Http => "http",
            Listener::Admin => "admin",
        }
    }

    /// The protocols it offers by ALPN, preferred first: gRPC needs HTTP/2; the HTTP listeners
    /// serve both (a client that offers only `http/1.1` gets it).
    fn alpn(self) -> Vec<Vec<u8>> {
        match self {
            Listener::Grpc => vec![b"h2".to_vec()],
            Listener::Http | Listener::Admin => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        }
    }
}

/// The TLS of every listener that has it, loaded at start by [`Tls::load`].
pub(crate) struct Tls {
    listeners: Vec<(Listener, Arc<Reloading>, Acceptor)>,
    every: Duration,
}

impl Tls {
    /// Loads the files of every listener in `settings` and builds their acceptors; no listener
    /// has TLS when none is configured.
    ///
    /// Errors: every listener's problem (a file that cannot be read, does not hold what it
    /// should, a key that is not the certificate's), one per line, each naming the setting and
    /// the path, never a file's contents.
    pub(crate) fn load(settings: &TlsSettings) -> Result<Tls, String> {
        let provider = material::provider();
        let mut listeners = Vec::new();
        let mut problems = Vec::new();
        for (listener, tls) in [
            (Listener::Grpc, &settings.grpc),
            (Listener::Http, &settings.http),
            (Listener::Admin, &settings.admin),
        ] {
            let Some(tls) = tls else { continue };
            let loaded = Reloading::load(listener.name(), tls, provider.clone())
                .map(Arc::new)
                .and_then(|reloading| {
                    let acceptor = acceptor(listener, &reloading)?;
                    Ok((listener, reloading, acceptor))
                });
            match loaded {
                Ok(loaded) => listeners.push(loaded),
                Err(problem) => problems.push(problem),
            }
        }
        crate::store::settings::all_problems(problems, "\n  ")?;
        for (_, reloading, _) in &listeners {
            let cert = &reloading.current().cert;
            tracing::info!(
                listener = reloading.listener,
                subject = %cert.subject,
                serial = %cert.serial,
                not_after = %cert.not_after_rfc3339(),
                client_certificates = reloading.tls.client_ca_file.is_some(),
                client_sans = ?reloading.tls.client_sans,
                "TLS on"
            );
        }
        Ok(Tls {
            listeners,
            every: settings.reload_seconds.duration().max(Duration::from_secs(1)),
        })
    }

    /// The acceptor of `listener`, when it has TLS.
    pub(crate) fn acceptor(&self, listener: Listener) -> Option<Acceptor> {
        self.listeners
            .iter()
            .find(|(l, _, _)| *l == listener)
            .map(|(_, _, acceptor)| acceptor.clone())
    }

    /// Checks every listener's files every `tls.reload_seconds` from now on (see
    /// [`Reloading::check`]); nothing to do, and no task, without TLS.
    pub(crate) fn spawn_reload(&self) {
        if self.listeners.is_empty() {
            return;
        }
        let reloadings: Vec<Arc<Reloading>> = self.listeners.iter().map(|(_, r, _)| r.clone()).collect();
        let every = self.every;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let reloadings = reloadings.clone();
                // Off the runtime's threads: it reads files.
                let _ =
                    tokio::task::spawn_blocking(move || reloadings.iter().map(|r| r.check()).collect::<Vec<Checked>>())
                        .await;
            }
        });
    }

    /// `/config`'s `tls`: per listener with TLS, its files (paths, never contents), the
    /// certificate in use (subject, serial, `not_after` as RFC 3339 and Unix seconds) and,
    /// while changed files do not load, `last_failure` (since when, and why); `{}` without TLS.
    pub(crate) fn status_json(&self) -> Value {
        Value::Object(
            self.listeners
                .iter()
                .map(|(listener, reloading, _)| (listener.name().to_owned(), reloading.status_json()))
                .collect(),
        )
    }

    /// The listeners with TLS for the start-up log: `grpc (client certificates), admin`, or
    /// `off`.
    pub(crate) fn summary(&self) -> String {
        let names: Vec<String> = self
            .listeners
            .iter()
            .map(|(listener, reloading, _)| match reloading.tls.client_ca_file {
                Some(_) => format!("{} (client certificates)", listener.name()),
                None => listener.name().to_owned(),
            })
            .collect();
        if names.is_empty() {
            "off".to_owned()
        } else {
            names.join(", ")
        }
    }
}

/// The acceptor of `listener`, whose certificate (and client verifier, with a
/// `client_ca_file`) are those `reloading` holds at each handshake.
///
/// Errors: rustls refuses the protocol versions (never with its own provider).
fn acceptor(listener: Listener, reloading: &Arc<Reloading>) -> Result<Acceptor, String> {
    let builder = ServerConfig::builder_with_provider(material::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls.{}: {e}", listener.name()))?;
    let builder = if reloading.tls.client_ca_file.is_some() {
        builder.with_client_cert_verifier(Arc::new(CurrentVerifier(reloading.clone())))
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder.with_cert_resolver(Arc::new(CurrentCert(reloading.clone())));
    config.alpn_protocols = listener.alpn();
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Acceptor {
        tls: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        listener: listener.name(),
    })
}
