//! A listener's TLS material read from its files: the certificate chain and key rustls serves,
//! the client-certificate verifier (the CA, and the subject alternative names a client must
//! carry), and what is shown of the certificate (subject, serial, expiry). Every error names
//! the listener's setting and the file, never a file's contents.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::server::tls::ListenerTls;

/// The bytes of one listener's files, as read together.
pub(crate) struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Option<Vec<u8>>,
}

impl Files {
    /// Reads the files of `tls.<listener>`.
    ///
    /// Errors: a file that cannot be read, naming the setting, the path and the reason.
    pub(crate) fn read(listener: &str, tls: &ListenerTls) -> Result<Files, String> {
        let read = |field: &str, path: &Path| {
            std::fs::read(path).map_err(|e| format!("tls.{listener}.{field}: cannot read {}: {e}", path.display()))
        };
        Ok(Files {
            cert: read("cert_file", &tls.cert_file)?,
            key: read("key_file", &tls.key_file)?,
            ca: match &tls.client_ca_file {
                Some(path) => Some(read("client_ca_file", path)?),
                None => None,
            },
        })
    }

    /// A digest of every file's bytes: equal digests, identical files.
    pub(crate) fn fingerprint(&self) -> [u8; 32] {
        let mut digest = Sha256::new();
        for part in [Some(&self.cert), Some(&self.key), self.ca.as_ref()] {
            match part {
                Some(bytes) => {
                    digest.update((bytes.len() as u64).to_be_bytes());
                    digest.update(bytes);
                }
                None => digest.update(u64::MAX.to_be_bytes()),
            }
        }
        digest.finalize().into()
    }
}

/// What is shown of a listener's certificate: in `/config`, the log and the expiry metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CertInfo {
    /// The subject's distinguished name (`CN=tollgate`).
    pub(crate) subject: String,
    /// The serial number, hexadecimal bytes separated by colons.
    pub(crate) serial: String,
    /// The end of its validity (notAfter), Unix seconds.
    pub(crate) not_after: i64,
}

impl CertInfo {
    /// The certificate's fields, from its DER bytes.
    ///
    /// Errors: bytes that are not an X.509 certificate.
    pub(crate) fn of(der: &[u8]) -> Result<CertInfo, String> {
        let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
        Ok(CertInfo {
            subject: cert.subject().to_string(),
            serial: cert.raw_serial_as_string(),
            not_after: cert.validity().not_after.timestamp(),
        })
    }

    /// `not_after` as RFC 3339 UTC (`2027-01-31T12:00:00Z`).
    pub(crate) fn not_after_rfc3339(&self) -> String {
        chrono::DateTime::from_timestamp(self.not_after, 0).map_or_else(
            || self.not_after.to_string(),
            |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        )
    }
}

/// One listener's material, built whole from one reading of its files.
pub(crate) struct Material {
    /// The certificate chain and the signing key handed to rustls.
    pub(crate) key: Arc<CertifiedKey>,
    /// The client-certificate verifier, when the listener has a `client_ca_file`.
    pub(crate) verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The listener's certificate, as shown.
    pub(crate) cert: CertInfo,
    /// [`Files::fingerprint`] of the files it was built from.
    pub(crate) fingerprint: [u8; 32],
}

/// The crypto provider of every listener: rustls with ring.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Material {
    /// Builds the material of `tls.<listener>` from `files`.
    ///
    /// Errors: a file without the PEM blocks it should hold, a certificate that does not parse,
    /// a key of a kind rustls cannot sign with or that is not the certificate's, a CA file
    /// without a usable CA certificate; each naming the setting and the path.
    pub(crate) fn build(
        listener: &str,
        tls: &ListenerTls,
        files: &Files,
        provider: &Arc<CryptoProvider>,
    ) -> Result<Material, String> {
        let cert_path = tls.cert_file.display();
        let chain = CertificateDer::pem_slice_iter(&files.cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("tls.{listener}.cert_file {cert_path}: not PEM certificates: {e}"))?;
        let Some(first) = chain.first() else {
            return Err(format!(
                "tls.{listener}.cert_file {cert_path}: no certificate in it (a PEM `CERTIFICATE` block)"
            ));
        };
        let cert = CertInfo::of(first).map_err(|e| format!("tls.{listener}.cert_file {cert_path}: {e}"))?;
        // Never the parser's own error: some quote what they read (a key on one line, its
        // newlines lost, is reported as a missing end marker holding the whole key).
        let key = PrivateKeyDer::from_pem_slice(&files.key).map_err(|_| {
            if is_encrypted(&files.key) {
                return format!(
                    "tls.{listener}.key_file {}: the key is encrypted with a passphrase, which tollgate cannot \
                     read; give it the key unencrypted (`openssl pkey -in <file> -out <new file>`), as a \
                     Kubernetes TLS Secret holds it",
                    tls.key_file.display()
                );
            }
            format!(
                "tls.{listener}.key_file {}: no usable private key in it (a PEM `PRIVATE KEY`, `RSA PRIVATE KEY` \
                 or `EC PRIVATE KEY` block, each marker on a line of its own)",
                tls.key_file.display()
            )
        })?;
        let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| {
            format!(
                "tls.{listener}.key_file {} cannot be used with the certificate of {cert_path}: {e}",
                tls.key_file.display()
            )
        })?;
        let verifier = match (&tls.client_ca_file, &files.ca) {
            (Some(path), Some(ca)) => Some(
                client_verifier(ca, &tls.client_sans, provider)
                    .map_err(|e| format!("tls.{listener}.client_ca_file {}: {e}", path.display()))?,
            ),
            _ => None,
        };
        Ok(Material {
            key: Arc::new(key),
            verifier,
            cert,
            fingerprint: files.fingerprint(),
        })
    }
}

/// A verifier of client certificates against the CA certificates in `ca` (PEM), which also
/// requires one of `sans` when given.
///
/// Errors: `ca` holds no certificate, or none rustls can use as a trust anchor.
fn client_verifier(
    ca: &[u8],
    sans: &[String],
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        let cert = cert.map_err(|e| format!("not PEM certificates: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("a certificate in it is not a usable CA: {e}"))?;
    }
    if roots.is_empty() {
        return Err("no CA certificate in it (a PEM `CERTIFICATE` block)".to_owned());
    }
    let webpki = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| format!("cannot verify clients with it: {e}"))?;
    Ok(if sans.is_empty() {
        webpki
    } else {
        Arc::new(SanChecked {
            inner: webpki,
            sans: sans.to_vec(),
        })
    })
}

/// A client verifier that also requires one of `sans` in the client's certificate, once
/// `inner` has verified it.
#[derive(Debug)]
struct SanChecked {
    inner: Arc<dyn ClientCertVerifier>,
    sans: Vec<String>,
}

impl ClientCertVerifier for SanChecked {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        if carries_one_of(end_entity, &self.sans) {
            Ok(verified)
        } else {
            Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Whether the certificate `der` carries one of `wanted` among its subject alternative names:
/// a DNS name equal to it (ASCII case and a final dot aside), or a wildcard `*.rest` when it is
/// one label followed by `.rest`; a URI equal to it; an IP address equal to it. A certificate
/// that does not parse, or has no such extension, carries none. (The subject's common name is
/// not read, as in browsers and Go.)
pub(crate) fn carries_one_of(der: &[u8], wanted: &[String]) -> bool {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return false;
    };
    let Ok(Some(sans)) = cert.subject_alternative_name() else {
        return false;
    };
    sans.value.general_names.iter().any(|name| match name {
        GeneralName::DNSName(dns) => wanted.iter().any(|w| dns_matches(dns, w)),
        GeneralName::URI(uri) => wanted.iter().any(|w| w == uri),
        GeneralName::IPAddress(bytes) => ip_of(bytes).is_some_and(|ip| wanted.iter().any(|w| w.parse() == Ok(ip))),
        _ => false,
    })
}

/// Whether the certificate's DNS name `presented` (perhaps `*.example.com`) covers `wanted`.
fn dns_matches(presented: &str, wanted: &str) -> bool {
    let presented = presented.trim_end_matches('.');
    let wanted = wanted.trim_end_matches('.');
    if wanted.parse::<IpAddr>().is_ok() {
        return false;
    }
    if presented.eq_ignore_ascii_case(wanted) {
        return true;
    }
    match (presented.strip_prefix("*."), wanted.split_once('.')) {
        (Some(rest), Some((label, wanted_rest))) => {
            !label.is_empty() && label != "*" && !rest.is_empty() && rest.eq_ignore_ascii_case(wanted_rest)
        }
        _ => false,
    }
}

/// An IP address SAN's bytes (4 or 16) as an address.
fn ip_of(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
        _ => None,
    }
}

/// Whether `pem` holds a passphrase-protected key: PKCS#8's `ENCRYPTED PRIVATE KEY`, or the
/// legacy `Proc-Type: 4,ENCRYPTED` header of an `RSA`/`EC PRIVATE KEY`.
fn is_encrypted(pem: &[u8]) -> bool {
    let has = |needle: &[u8]| pem.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_names_match_exactly_or_by_one_wildcard_label() {
        for (presented, wanted) in [
            ("envoy", "envoy"),
            ("Envoy.Gateway.svc", "envoy.gateway.svc."),
            ("*.envoy-gateway-system", "envoy-abc.envoy-gateway-system"),
            ("*.example.com", "A.EXAMPLE.com"),
        ] {
            assert!(dns_matches(presented, wanted), "{presented} should cover {wanted}");
        }
        for (presented, wanted) in [
            ("envoy", "envoy2"),
            ("*.example.com", "example.com"),
            ("*.example.com", "a.b.example.com"),
            ("*.example.com", ".example.com"),
            ("*.", "a."),
            ("10.0.0.1", "10.0.0.1"),
        ] {
            assert!(!dns_matches(presented, wanted), "{presented} should not cover {wanted}");
        }
    }

    #[test]
    fn ip_address_bytes() {
        assert_eq!(ip_of(&[127, 0, 0, 1]), Some(IpAddr::from([127, 0, 0, 1])));
        assert_eq!(ip_of(&[0; 16]), Some("::".parse().unwrap()));
        assert_eq!(ip_of(&[1, 2, 3]), None);
    }

    /// A key whose newlines were lost (a Secret written with `echo $KEY`) is refused without
    /// a byte of it in the message: the PEM parser's own error would quote the key.
    #[test]
    fn a_key_on_one_line_is_refused_without_quoting_it() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["tollgate".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let one_line = key.serialize_pem().replace('\n', " ");
        let tls = ListenerTls {
            cert_file: "/certs/tls.crt".into(),
            key_file: "/certs/tls.key".into(),
            client_ca_file: None,
            client_sans: Vec::new(),
        };
        let files = Files {
            cert: cert.pem().into_bytes(),
            key: one_line.into_bytes(),
            ca: None,
        };
        let err = Material::build("grpc", &tls, &files, &provider())
            .err()
            .expect("refused");
        assert_eq!(
            err,
            "tls.grpc.key_file /certs/tls.key: no usable private key in it (a PEM `PRIVATE KEY`, `RSA PRIVATE KEY` \
             or `EC PRIVATE KEY` block, each marker on a line of its own)"
        );
    }

    /// A passphrase-protected key is named as such (PKCS#8, and the legacy PEM header).
    #[test]
    fn an_encrypted_key_is_refused_saying_so() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["tollgate".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let tls = ListenerTls {
            cert_file: "/certs/tls.crt".into(),
            key_file: "/certs/tls.key".into(),
            client_ca_file: None,
            client_sans: Vec::new(),
        };
        for encrypted in [
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIFHDBOBgkqhkiG9w0BBQ0wQTAp\n-----END ENCRYPTED PRIVATE KEY-----\n",
            "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00\n\nAAAA\n-----END RSA PRIVATE KEY-----\n",
        ] {
            let files = Files {
                cert: cert.pem().into_bytes(),
                key: encrypted.as_bytes().to_vec(),
                ca: None,
            };
            let err = Material::build("grpc", &tls, &files, &provider())
                .err()
                .expect("refused");
            assert!(
                err.starts_with("tls.grpc.key_file /certs/tls.key: the key is encrypted with a passphrase"),
                "{err}"
            );
            assert!(!err.contains("MIIFHDBO") && !err.contains("AAAA"), "{err}");
        }
    }

    #[test]
    fn the_fingerprint_tells_which_file_changed() {
        let files = |cert: &[u8], key: &[u8], ca: Option<&[u8]>| Files {
            cert: cert.to_vec(),
            key: key.to_vec(),
            ca: ca.map(<[u8]>::to_vec),
        };
        let base = files(b"c", b"k", None).fingerprint();
        assert_eq!(base, files(b"c", b"k", None).fingerprint());
        assert_ne!(base, files(b"c", b"k2", None).fingerprint());
        assert_ne!(
            base,
            files(b"ck", b"", None).fingerprint(),
            "bytes do not move across files"
        );
        assert_ne!(
            base,
            files(b"c", b"k", Some(b"")).fingerprint(),
            "an empty CA is not none"
        );
    }
}
