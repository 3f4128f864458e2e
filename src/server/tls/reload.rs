//! Each TLS listener's material in an `ArcSwap`, which rustls reads at every handshake through
//! [`CurrentCert`] (the certificate and key) and [`CurrentVerifier`] (the client CA), so a
//! swap takes effect for the next connection and never touches an open one. [`Reloading::check`]
//! reads the files again and swaps in what changed; a change that does not load keeps the
//! material in use.

use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use serde_json::{json, Value};

use crate::server::tls::material::{Files, Material};
use crate::server::tls::ListenerTls;

/// One listener's TLS: its settings and the material in use.
pub(crate) struct Reloading {
    /// `grpc`, `http` or `admin`.
    pub(crate) listener: &'static str,
    /// Its `tls.<listener>` settings.
    pub(crate) tls: ListenerTls,
    provider: Arc<CryptoProvider>,
    current: ArcSwap<Material>,
    /// Why the files on disk are not in use, while they are not (shown in `/config`).
    failure: Mutex<Option<Failure>>,
}

/// Files that did not load: which content (to report it once), and why.
#[derive(Clone)]
struct Failure {
    /// The files' fingerprint, or `None` when they could not be read.
    fingerprint: Option<[u8; 32]>,
    error: String,
    /// Unix seconds of the first check that saw it.
    since: i64,
    /// Seen on two checks in a row: logged and counted (a rotation caught halfway, the
    /// certificate written and not yet its key, is seen once and then loads).
    reported: bool,
}

/// What [`Reloading::check`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Checked {
    /// The files are the ones in use.
    Unchanged,
    /// Changed files were loaded: new connections get them.
    Reloaded,
    /// Changed files did not load; the material in use stays.
    Failed,
}

impl Reloading {
    /// Loads `tls.<listener>` from its files.
    ///
    /// Errors: see [`Files::read`] and [`Material::build`].
    pub(crate) fn load(
        listener: &'static str,
        tls: &ListenerTls,
        provider: Arc<CryptoProvider>,
    ) -> Result<Reloading, String> {
        let files = Files::read(listener, tls)?;
        let material = Material::build(listener, tls, &files, &provider)?;
        crate::telemetry::tls_certificate_loaded(listener, material.cert.not_after, true);
        Ok(Reloading {
            listener,
            tls: tls.clone(),
            provider,
            current: ArcSwap::from_pointee(material),
            failure: Mutex::new(None),
        })
    }

    /// The material in use.
    pub(crate) fn current(&self) -> Arc<Material> {
        self.current.load_full()
    }

    /// Reads the files and swaps them in when they changed and load; logs and counts a reload,
    /// and a failure once per content that keeps failing. Blocking (it reads files).
    pub(crate) fn check(&self) -> Checked {
        let read = Files::read(self.listener, &self.tls);
        let fingerprint = read.as_ref().ok().map(Files::fingerprint);
        if fingerprint == Some(self.current.load().fingerprint) {
            self.failure.lock().unwrap_or_else(PoisonError::into_inner).take();
            return Checked::Unchanged;
        }
        let built = read.and_then(|files| Material::build(self.listener, &self.tls, &files, &self.provider));
        match built {
            Ok(material) => {
                let cert = material.cert.clone();
                self.current.store(Arc::new(material));
                self.failure.lock().unwrap_or_else(PoisonError::into_inner).take();
                crate::telemetry::tls_certificate_loaded(self.listener, cert.not_after, false);
                tracing::info!(
                    listener = self.listener,
                    subject = %cert.subject,
                    serial = %cert.serial,
                    not_after = %cert.not_after_rfc3339(),
                    "TLS certificate reloaded: new connections use it, open ones keep theirs"
                );
                Checked::Reloaded
            }
            Err(error) => {
                self.failed(fingerprint, error);
                Checked::Failed
            }
        }
    }

    /// Records files that did not load: logged and counted when the same content failed on the
    /// check before too, once.
    fn failed(&self, fingerprint: Option<[u8; 32]>, error: String) {
        let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        let same = failure
            .as_ref()
            .is_some_and(|f| f.fingerprint == fingerprint && f.error == error);
        if !same {
            tracing::debug!(listener = self.listener, %error, "TLS files changed and do not load (yet)");
            *failure = Some(Failure {
                fingerprint,
                error,
                since: unix_now(),
                reported: false,
            });
            return;
        }
        if let Some(f) = failure.as_mut().filter(|f| !f.reported) {
            f.reported = true;
            crate::telemetry::tls_reload_failed(self.listener);
            tracing::warn!(
                listener = self.listener,
                error = %f.error,
                "TLS files changed and do not load: the certificate in use stays until they do"
            );
        }
    }

    /// This listener in `/config`: its files (paths), the certificate in use, and why the files
    /// on disk are not in use, if they are not.
    pub(crate) fn status_json(&self) -> Value {
        let current = self.current.load();
        let failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner).clone();
        json!({
            "cert_file": self.tls.cert_file,
            "key_file": self.tls.key_file,
            "client_ca_file": self.tls.client_ca_file,
            "client_sans": self.tls.client_sans,
            "certificate": {
                "subject": current.cert.subject,
                "serial": current.cert.serial,
                "not_after": current.cert.not_after_rfc3339(),
                "not_after_unix": current.cert.not_after,
            },
            "last_failure": failure.filter(|f| f.reported).map(|f| json!({
                "since_unix": f.since,
                "error": f.error,
            })),
        })
    }
}

/// The current Unix time in whole seconds.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The certificate and key of a listener's material in use, for every handshake.
#[derive(Debug)]
pub(crate) struct CurrentCert(pub(crate) Arc<Reloading>);

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().key.clone())
    }
}

/// The client verifier of a listener's material in use (a listener with `client_ca_file`), for
/// every handshake. It sends no CA names in its certificate request (they would have to be
/// those of the CA in use at each handshake); clients send their certificate either way.
#[derive(Debug)]
pub(crate) struct CurrentVerifier(pub(crate) Arc<Reloading>);

impl CurrentVerifier {
    /// The verifier in use, or the error a listener without one answers (never the case: a
    /// listener gets a `CurrentVerifier` only with a `client_ca_file`, whose material always
    /// has a verifier).
    fn inner(&self) -> Result<Arc<dyn ClientCertVerifier>, rustls::Error> {
        self.0
            .current
            .load()
            .verifier
            .clone()
            .ok_or_else(|| rustls::Error::General("no client CA loaded".into()))
    }
}

impl ClientCertVerifier for CurrentVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()?.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner()?.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner()?.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.provider.signature_verification_algorithms.supported_schemes()
    }
}

impl std::fmt::Debug for Reloading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("listener", &self.listener)
            .field("cert_file", &self.tls.cert_file)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for `cn` and its key, as PEM.
    fn certificate(cn: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[test]
    fn changed_files_are_swapped_in_and_bad_ones_reported_once_they_stay() {
        let dir = tempfile::tempdir().unwrap();
        let tls = ListenerTls {
            cert_file: dir.path().join("tls.crt"),
            key_file: dir.path().join("tls.key"),
            ..ListenerTls::default()
        };
        let write = |(cert, key): &(String, String)| {
            std::fs::write(&tls.cert_file, cert).unwrap();
            std::fs::write(&tls.key_file, key).unwrap();
        };
        let (first, second) = (certificate("first"), certificate("second"));
        write(&first);
        let reloading = Reloading::load("grpc", &tls, crate::server::tls::material::provider()).unwrap();
        assert_eq!(reloading.current().cert.subject, "CN=first");
        assert_eq!(reloading.check(), Checked::Unchanged);

        write(&second);
        assert_eq!(reloading.check(), Checked::Reloaded);
        assert_eq!(reloading.current().cert.subject, "CN=second");
        assert_eq!(reloading.check(), Checked::Unchanged);

        // The first certificate with the second's key: kept out, reported from the second check.
        std::fs::write(&tls.cert_file, &first.0).unwrap();
        assert_eq!(reloading.check(), Checked::Failed);
        assert_eq!(
            reloading.status_json()["last_failure"],
            Value::Null,
            "caught halfway, maybe"
        );
        assert_eq!(reloading.check(), Checked::Failed);
        let error = reloading.status_json()["last_failure"]["error"].clone();
        assert!(
            error.as_str().is_some_and(|e| e.contains("tls.grpc.key_file")),
            "{error}"
        );
        assert_eq!(
            reloading.current().cert.subject,
            "CN=second",
            "the material in use stays"
        );

        // A missing file is a failure too; back to the files in use clears it.
        std::fs::remove_file(&tls.cert_file).unwrap();
        assert_eq!(reloading.check(), Checked::Failed);
        write(&second);
        assert_eq!(reloading.check(), Checked::Unchanged);
        assert_eq!(reloading.status_json()["last_failure"], Value::Null);
    }
}
