//! The gRPC listener's address (`grpc_addr`: a TCP address, or `unix:<path>` for a Unix domain
//! socket), and the socket file behind a `unix:` one: binding it with its mode
//! (`grpc.unix_socket_mode`), replacing the file a crashed process left, refusing one another
//! process still serves, and removing it at a clean shutdown (docs/operations.md, "The gRPC
//! listener on a Unix socket").

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::net::{UnixListener, UnixStream};

/// Where the gRPC listener listens: `0.0.0.0:8081` (TCP) or `unix:/run/tollgate/rls.sock` (a
/// Unix domain socket; `unix:///run/tollgate/rls.sock`, the gRPC naming form, is the same). A
/// relative path is relative to the working directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrpcAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// The path of a Unix domain socket.
    Unix(PathBuf),
}

/// The longest socket path Linux takes: `sun_path` is 108 bytes with its terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

impl GrpcAddr {
    /// The TCP address, `None` for a Unix socket.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            GrpcAddr::Tcp(addr) => Some(*addr),
            GrpcAddr::Unix(_) => None,
        }
    }

    /// The socket path, `None` for a TCP address.
    pub fn unix(&self) -> Option<&Path> {
        match self {
            GrpcAddr::Tcp(_) => None,
            GrpcAddr::Unix(path) => Some(path),
        }
    }

    /// What is wrong with the address beyond its syntax (a socket path longer than the kernel
    /// takes), as a sentence naming `grpc_addr`.
    pub(crate) fn problem(&self) -> Option<String> {
        let path = self.unix()?;
        let len = path.as_os_str().len();
        (len > MAX_SOCKET_PATH).then(|| {
            format!(
                "grpc_addr {self}: the socket path is {len} bytes, longer than the {MAX_SOCKET_PATH} a Unix \
                 socket's address holds; choose a shorter path"
            )
        })
    }
}

impl From<SocketAddr> for GrpcAddr {
    fn from(addr: SocketAddr) -> Self {
        GrpcAddr::Tcp(addr)
    }
}

impl fmt::Display for GrpcAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrpcAddr::Tcp(addr) => addr.fmt(f),
            GrpcAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl FromStr for GrpcAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("unix:") {
            // `unix:///abs` (gRPC's URI form) names `/abs`; `unix:/abs` and `unix:rel` as written.
            let path = rest.strip_prefix("//").filter(|p| p.starts_with('/')).unwrap_or(rest);
            if path.is_empty() || path.ends_with('/') {
                return Err(format!("{s:?} names no socket file: write unix:/run/tollgate/rls.sock"));
            }
            return Ok(GrpcAddr::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>().map(GrpcAddr::Tcp).map_err(|_| {
            format!("{s:?} is neither an address with a port (0.0.0.0:8081, [::]:8081) nor unix:<path of a socket>")
        })
    }
}

impl Serialize for GrpcAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GrpcAddr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The permission bits of the socket file (`grpc.unix_socket_mode`), written as octal digits in
/// a string, `"0660"`. Connecting to a Unix socket needs write permission on its file, so
/// `"0660"` lets the owner and the group connect and nobody else. An unquoted `0660` reads as
/// the same digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketMode(pub u32);

impl FromStr for SocketMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let digits = s.strip_prefix("0o").unwrap_or(s);
        match u32::from_str_radix(digits, 8) {
            Ok(mode) if !digits.is_empty() && mode <= 0o777 => Ok(SocketMode(mode)),
            _ => Err(format!(
                "{s:?} is not a file mode: give up to three octal digits of permissions, as \"0660\""
            )),
        }
    }
}

impl fmt::Display for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl Serialize for SocketMode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SocketMode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Number(u64),
        }
        match Written::deserialize(deserializer)? {
            Written::Text(text) => text.parse().map_err(serde::de::Error::custom),
            Written::Number(n) => from_number(n).map_err(serde::de::Error::custom),
        }
    }
}

/// The mode of an unquoted number. A YAML `0660` and a `TOLLGATE_GRPC__UNIX_SOCKET_MODE=0660`
/// arrive as the number 660, whose decimal digits are the octal ones written; a YAML octal
/// literal `0o660` arrives as its value, 432. Above 511 (`0o777`) a number can only be digits;
/// at most 511, one with an 8 or a 9 can only be a value; any other (432: `0o660`, or digits
/// meaning `0o432`?) is refused rather than guessed, since a wrong guess can open the socket
/// to every local user.
fn from_number(n: u64) -> Result<SocketMode, String> {
    let digits = n.to_string();
    let octal_digits = digits.bytes().all(|b| (b'0'..=b'7').contains(&b));
    match n {
        512.. if octal_digits => digits.parse(),
        512.. => Err(format!(
            "{n} is not a file mode: give up to three octal digits, quoted, as \"0660\""
        )),
        _ if !octal_digits => Ok(SocketMode(n as u32)),
        _ => Err(format!(
            "the unquoted mode {n} is ambiguous (the digits {n}, or a YAML octal literal's value, \
             0o{n:o}?): quote it, as \"0660\""
        )),
    }
}

/// The socket file of a bound Unix listener: removed when dropped (at the end of `serve`,
/// whether it ended cleanly or with an error), unless another file has taken its path since.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    /// Device, inode and change time of the file bound, so a successor's socket at the same
    /// path is never removed by this process (an inode number can be reused at once).
    id: FileId,
    /// The lock on `<path>.lock` ([`bind`]), released after the file is removed.
    _lock: std::fs::File,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| file_id(&m) == self.id);
        if ours {
            match std::fs::remove_file(&self.path) {
                Ok(()) => tracing::info!(path = %self.path.display(), "removed the gRPC socket file"),
                Err(e) => tracing::warn!(path = %self.path.display(), "cannot remove the gRPC socket file: {e}"),
            }
        }
    }
}

/// What tells one file from another at the same path: device, inode, change time.
type FileId = (u64, u64, i64, i64);

fn file_id(meta: &std::fs::Metadata) -> FileId {
    (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec())
}

/// Binds a Unix listener at `path` with the permission bits `mode`. A socket file already at
/// `path` that nothing accepts on (connecting is refused: its process is gone) is replaced,
/// with a warning; one another process accepts on is left alone.
///
/// Two rules make this safe against a second tollgate starting at the same moment and against
/// a client connecting early. The process holds an exclusive lock on `<path>.lock` from the
/// check until it stops, so two starts cannot both find the old file stale and take turns
/// replacing it (the lock file is left in place: removing it would race the next holder). And
/// the socket is bound under a temporary name beside it, given its mode, then renamed over
/// `path`: it is never reachable with the umask's mode.
///
/// Errors, each naming the path: a process serves on it (or holds its lock); a file there is
/// not a socket (never removed); the file cannot be inspected, locked, bound (a missing
/// directory, no permission), given its mode or renamed into place.
pub(crate) fn bind(path: &Path, mode: SocketMode) -> anyhow::Result<(UnixListener, SocketFile)> {
    let shown = path.display();
    let lock = lock(path)?;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("cannot listen for gRPC on unix:{shown}: cannot inspect the path: {e}"),
        Ok(meta) if !meta.file_type().is_socket() => anyhow::bail!(
            "cannot listen for gRPC on unix:{shown}: the path exists and is not a socket; it is left as it is: \
             remove it or choose another grpc_addr"
        ),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => anyhow::bail!(
                "cannot listen for gRPC on unix:{shown}: another process is accepting connections on this socket; \
                 it is not taken over: stop that process or choose another grpc_addr"
            ),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tracing::warn!(path = %shown, "replacing a stale gRPC socket file (nothing accepts on it)");
            }
            Err(e) => anyhow::bail!(
                "cannot listen for gRPC on unix:{shown}: a socket file is there and cannot be tried ({e}); \
                 it is left as it is"
            ),
        },
    }
    let temp = path.with_file_name(format!(".tollgate-{}.sock", std::process::id()));
    // A leftover of an earlier start with this pid (only ever this process's name).
    let _ = std::fs::remove_file(&temp);
    let listener =
        UnixListener::bind(&temp).map_err(|e| anyhow::anyhow!("cannot listen for gRPC on unix:{shown}: {e}"))?;
    let placed = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(mode.0))
        .map_err(|e| {
            anyhow::anyhow!("cannot set the mode {mode} (grpc.unix_socket_mode) on the socket file {shown}: {e}")
        })
        .and_then(|()| {
            std::fs::rename(&temp, path)
                .map_err(|e| anyhow::anyhow!("cannot put the socket file in place at {shown}: {e}"))
        });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    // From here on the file is ours: dropping `file` (an error, the end of `serve`) removes it.
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| anyhow::anyhow!("cannot listen for gRPC on unix:{shown}: the socket file vanished: {e}"))?;
    let file = SocketFile {
        path: path.to_owned(),
        id: file_id(&meta),
        _lock: lock,
    };
    Ok((listener, file))
}

/// The exclusive lock on `<path>.lock` (created if missing), held by this process while it
/// serves on `path`.
///
/// Errors: another process holds it (starting or serving on `path`), or the file cannot be
/// opened (the directory missing or not writable).
fn lock(path: &Path) -> anyhow::Result<std::fs::File> {
    let shown = path.display();
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock_path = PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot listen for gRPC on unix:{shown}: cannot open {}: {e}",
                lock_path.display()
            )
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "cannot listen for gRPC on unix:{shown}: another process is accepting connections on this socket, or \
             starting to (it holds {}); it is not taken over: stop that process or choose another grpc_addr",
            lock_path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            anyhow::bail!(
                "cannot listen for gRPC on unix:{shown}: cannot lock {}: {e}",
                lock_path.display()
            )
        }
    }
}

/// A Unix listener's accepted connections, as the stream tonic serves.
pub(crate) struct UnixIncoming(pub(crate) UnixListener);

impl futures_util::Stream for UnixIncoming {
    type Item = std::io::Result<UnixStream>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0
            .poll_accept(cx)
            .map(|accepted| Some(accepted.map(|(stream, _)| stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_print_back() {
        for text in [
            "0.0.0.0:8081",
            "[::]:8081",
            "unix:/run/tollgate/rls.sock",
            "unix:rls.sock",
        ] {
            let addr: GrpcAddr = text.parse().unwrap();
            assert_eq!(addr.to_string(), text);
        }
        let uri: GrpcAddr = "unix:///run/tollgate/rls.sock".parse().unwrap();
        assert_eq!(uri, GrpcAddr::Unix("/run/tollgate/rls.sock".into()));
        for bad in ["unix:", "unix:/run/", "localhost:8081", "8081", "/run/rls.sock"] {
            let e = bad.parse::<GrpcAddr>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        let long = GrpcAddr::Unix(PathBuf::from(format!("/{}", "a".repeat(120))));
        assert!(long.problem().unwrap().contains("longer than the 107"));
        assert_eq!(GrpcAddr::Unix("/run/x.sock".into()).problem(), None);
    }

    #[test]
    fn modes_are_octal_digits_quoted_or_not() {
        assert_eq!("0660".parse::<SocketMode>(), Ok(SocketMode(0o660)));
        assert_eq!("600".parse::<SocketMode>(), Ok(SocketMode(0o600)));
        assert_eq!("0o777".parse::<SocketMode>(), Ok(SocketMode(0o777)));
        assert_eq!(SocketMode(0o660).to_string(), "0660");
        for bad in ["", "0680", "1777", "rw-rw----"] {
            assert!(bad.parse::<SocketMode>().unwrap_err().contains("octal"), "{bad}");
        }
        let from_number: SocketMode = serde_json::from_str("660").unwrap();
        assert_eq!(from_number, SocketMode(0o660));
        let from_text: SocketMode = serde_json::from_str("\"0600\"").unwrap();
        assert_eq!(from_text, SocketMode(0o600));
    }

    /// A YAML octal literal arrives as its value: `0o660` is 432, which was read as the digits
    /// of `0o432` (others may write to the socket). Read right when only one reading exists,
    /// refused when two do.
    #[test]
    fn a_yaml_octal_literal_is_read_right_or_refused() {
        let read = |yaml: &str| serde_yaml::from_str::<SocketMode>(yaml).map_err(|e| e.to_string());
        let ambiguous = read("0o660").unwrap_err();
        assert!(
            ambiguous.contains("ambiguous") && ambiguous.contains("0o660"),
            "{ambiguous}"
        );
        assert_eq!(read("0o600"), Ok(SocketMode(0o600)), "384: only a value has an 8");
        assert_eq!(read("0660"), Ok(SocketMode(0o660)), "the digits written");
        assert_eq!(read("\"0o660\""), Ok(SocketMode(0o660)));
        assert!(read("999").is_err());
    }

    #[tokio::test]
    async fn a_socket_is_bound_with_its_mode_and_removed_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rls.sock");
        let (listener, file) = bind(&path, SocketMode(0o600)).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        drop(listener);
        drop(file);
        assert!(!path.exists(), "the socket file is removed at the end");
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_is_not_stolen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rls.sock");
        // A socket file nothing accepts on: what a crash leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let (live, file) = bind(&path, SocketMode(0o660)).unwrap();
        let e = bind(&path, SocketMode(0o660)).unwrap_err().to_string();
        assert!(e.contains("another process is accepting"), "{e}");
        assert!(path.exists(), "a live socket stays");
        drop(live);
        drop(file);
    }

    /// Two starts on one stale file at the same moment: one binds, the other is refused (both
    /// found it stale before the lock, and the second replaced the first's socket).
    #[tokio::test]
    async fn two_starts_on_a_stale_file_bind_once() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("rls.sock");
            drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
            let starts: Vec<_> = (0..2)
                .map(|_| {
                    let (path, barrier) = (path.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        let _in = rt.enter();
                        barrier.wait();
                        bind(&path, SocketMode(0o600)).map(|(l, f)| (l.into_std().unwrap(), f))
                    })
                })
                .collect();
            let results: Vec<_> = starts.into_iter().map(|t| t.join().unwrap()).collect();
            let bound: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            assert_eq!(bound.len(), 1, "exactly one start binds");
            let (listener, _) = bound[0];
            // The socket at the path is the winner's: a connection reaches its listener.
            let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();
            listener.set_nonblocking(false).unwrap();
            listener.accept().expect("the winner's listener is the one at the path");
        }
    }

    #[tokio::test]
    async fn a_file_that_is_not_a_socket_is_never_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rls.sock");
        std::fs::write(&path, "data").unwrap();
        let e = bind(&path, SocketMode(0o660)).unwrap_err().to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    }

    #[tokio::test]
    async fn a_successors_socket_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rls.sock");
        let (listener, file) = bind(&path, SocketMode(0o660)).unwrap();
        drop(listener);
        // Another process replaced the stale file with its own before this one's guard ran.
        std::fs::remove_file(&path).unwrap();
        let other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(file);
        assert!(path.exists(), "the other socket stays");
        drop(other);
    }
}
