//! Certificates made by the `openssl` command, for the tests that need what rcgen (with ring)
//! cannot make: RSA keys, as Envoy Gateway's certgen writes them (PKCS#1 PEM). A [`Certs`] is a
//! temporary directory holding a self-made CA (`ca.crt`, `ca.key`) and the certificates it
//! issued (`<name>.crt`, `<name>.key`), read back as files or as a tonic server's TLS.
//!
//! Used by `xds_rules.rs` and `xds_envoy.rs` (the mutual TLS of Envoy Gateway's xDS) and by
//! `tls_listeners.rs` (Envoy Gateway-shaped RSA certificates on the gRPC listener). Every call
//! blocks while `openssl` runs; from an async test call it inside `block_in_place`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// `openssl req` arguments for a new P-256 key, unencrypted.
const EC_KEY: [&str; 5] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];

/// The key of a certificate [`Certs`] makes: its CA's ([`Certs::with_ca`]) or one it issues
/// ([`Certs::issue`]).
#[derive(Clone, Copy)]
pub enum Key {
    /// P-256, written as PKCS#8.
    Ec,
    /// RSA 2048, written as PKCS#1 (`BEGIN RSA PRIVATE KEY`), as Envoy Gateway writes its
    /// certificates' keys.
    RsaPkcs1,
}

/// A temporary directory of certificates made by `openssl`, all valid for two days: a CA
/// (`ca.crt`, `ca.key`; made by [`Certs::with_ca`]) and the certificates it issued
/// ([`Certs::issue`]). [`Certs::make`] is the mutual TLS Envoy Gateway sets up for its xDS
/// server (as the Postgres TLS test makes its own certificate). Removed when dropped.
pub struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    /// A P-256 CA `/CN=test-ca`, and from it `server` (`/CN=xds.test`, SAN `DNS:xds.test`,
    /// serverAuth) and `client` (`/CN=envoy-ratelimit`, SAN `DNS:envoy-ratelimit`, clientAuth),
    /// each a P-256 `.crt` and `.key`, in a new temporary directory.
    pub fn make() -> Certs {
        let certs = Certs::with_ca("test-ca", Key::Ec);
        certs.issue(
            "server",
            "xds.test",
            "subjectAltName=DNS:xds.test\nextendedKeyUsage=serverAuth\n",
            Key::Ec,
            None,
        );
        certs.issue(
            "client",
            "envoy-ratelimit",
            "subjectAltName=DNS:envoy-ratelimit\nextendedKeyUsage=clientAuth\n",
            Key::Ec,
            None,
        );
        certs
    }

    /// A new temporary directory holding only a self-signed CA, `ca.crt` and `ca.key`, for the
    /// subject `/CN=<cn>` with a `key` of that kind: `CA:TRUE` (critical) and key usages
    /// keyCertSign and cRLSign (critical).
    pub fn with_ca(cn: &str, key: Key) -> Certs {
        let certs = Certs {
            dir: tempfile::tempdir().unwrap(),
        };
        let subject = format!("/CN={cn}");
        certs.request(
            key,
            "ca.key",
            &[
                "req",
                "-x509",
                "-days",
                "2",
                "-subj",
                &subject,
                "-out",
                "ca.crt",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        certs
    }

    /// Runs `openssl` with `args` in the certificates' directory; panics with its stderr if it
    /// fails.
    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs the `openssl req` of `args` with a new key of kind `key`, written to `key_file`.
    fn request(&self, key: Key, key_file: &str, args: &[&str]) {
        match key {
            Key::Ec => self.openssl(&[args, &["-keyout", key_file][..], &EC_KEY[..]].concat()),
            Key::RsaPkcs1 => {
                self.openssl(&["genrsa", "-traditional", "-out", key_file, "2048"]);
                self.openssl(&[args, &["-new", "-key", key_file][..]].concat());
            }
        }
    }

    /// Issues `<name>.crt` and `<name>.key` from the CA, for the subject `/CN=<cn>` with the
    /// X.509 extensions `ext` (an `openssl -extfile`, one `name=value` a line) and a `key` of
    /// that kind. The serial number is `serial` (1001 shows as `03:e9`), or a random one.
    pub fn issue(&self, name: &str, cn: &str, ext: &str, key: Key, serial: Option<u32>) {
        std::fs::write(self.path(&format!("{name}.ext")), ext).unwrap();
        let (key_file, csr, crt, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        let subject = format!("/CN={cn}");
        self.request(key, &key_file, &["req", "-subj", &subject, "-out", &csr]);
        let serial = serial.map(|n| n.to_string());
        let serial = match &serial {
            Some(n) => vec!["-set_serial", n],
            None => vec!["-CAcreateserial"],
        };
        self.openssl(
            &[
                &[
                    "x509", "-req", "-days", "2", "-in", &csr, "-CA", "ca.crt", "-CAkey", "ca.key",
                ][..],
                &serial,
                &["-out", &crt, "-extfile", &extfile],
            ]
            .concat(),
        );
    }

    /// Where the file `name` (`ca.crt`, `client.key`, ...) is.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The contents of the file `name`.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).unwrap()
    }

    /// A tonic server's TLS: the certificate `server.crt` with `server.key`, and client
    /// certificates required, from the CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(self.read("server.crt"), self.read("server.key")))
            .client_ca_root(Certificate::from_pem(self.read("ca.crt")))
    }
}
