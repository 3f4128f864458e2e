//! The container image without a Docker engine: the `Dockerfile` is read statically (its
//! runtime stage's COPY, ENV, WORKDIR, USER, EXPOSE, HEALTHCHECK and ENTRYPOINT), a temporary
//! directory is filled with exactly the files that stage copies, and the release binary is run
//! from it the way the image runs: as uid and gid 65534 with no supplementary groups, from the
//! image's WORKDIR, with the image's ENV only, and with the whole filesystem read-only for it
//! (a private mount namespace, `unshare --mount`, in which the copy and `/` are remounted
//! read-only). Real Envoy then limits traffic through it with the shipped `envoy/envoy.yaml`.
//!
//! The binary: `$TOLLGATE_RELEASE_BIN` (scripts/test builds it with `cargo build --release
//! --locked`, beside the instruction gate's driver), else `target/release/tollgate` if present, else the test profile's
//! binary with a note; under `CI=true` the release one is required. These tests need root (for
//! the mount namespace and `setpriv`), `unshare` and `setpriv` (util-linux), and Envoy
//! (`support::envoy_or_skip`); `hadolint` comes from `support::tools`.

use crate::support;

use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::{envoy_or_skip, free_port, http_get, wait_until, ChildGuard, Envoy};

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
}

// ---------------------------------------------------------------------------------------------
// The Dockerfile, read as Docker reads it (the subset this project uses).

/// One instruction: its keyword (upper case) and the rest of the line, continuation lines
/// joined.
#[derive(Clone, Debug)]
struct Instruction {
    keyword: String,
    args: String,
}

/// A build stage: `FROM <base> [AS <name>]` and what follows up to the next `FROM`.
#[derive(Debug)]
struct Stage {
    base: String,
    name: Option<String>,
    instructions: Vec<Instruction>,
}

impl Stage {
    fn all(&self, keyword: &str) -> impl Iterator<Item = &Instruction> {
        let keyword = keyword.to_owned();
        self.instructions.iter().filter(move |i| i.keyword == keyword)
    }

    /// The last instruction `keyword` (the one in force, for WORKDIR, USER, ENTRYPOINT...).
    fn last(&self, keyword: &str) -> Option<&Instruction> {
        self.all(keyword).last()
    }

    /// ENV as Docker applies it: `KEY=VALUE` pairs (values optionally in double quotes), or the
    /// legacy `ENV KEY VALUE` form; later ones win.
    fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for i in self.all("ENV") {
            if !i.args.contains('=') {
                let (k, v) = i.args.split_once(' ').expect("ENV KEY VALUE");
                env.insert(k.to_owned(), v.trim().to_owned());
                continue;
            }
            for pair in shell_words(&i.args) {
                let (k, v) = pair
                    .split_once('=')
                    .unwrap_or_else(|| panic!("ENV {}: `{pair}` is not KEY=VALUE", i.args));
                env.insert(k.to_owned(), v.to_owned());
            }
        }
        env
    }
}

/// Whitespace-separated words; double quotes group (and are removed).
fn shell_words(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in text.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => {
                word.push(c);
                any = true;
            }
        }
    }
    assert!(!quoted, "unbalanced quotes in {text:?}");
    if any {
        words.push(word);
    }
    words
}

/// The stages of Dockerfile `text`. Comment lines are skipped, also between continuation lines
/// (Docker does the same); a parser directive (`# syntax=`) is a comment here.
fn parse_dockerfile(text: &str) -> Vec<Stage> {
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        logical.push(std::mem::take(&mut current));
    }
    assert!(current.is_empty(), "the Dockerfile ends in a continuation line");
    let mut stages: Vec<Stage> = Vec::new();
    for line in logical {
        let (keyword, args) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let keyword = keyword.to_ascii_uppercase();
        let args = args.trim().to_owned();
        if keyword == "FROM" {
            let words: Vec<&str> = args.split_whitespace().collect();
            let (base, name) = match words.as_slice() {
                [base] => (*base, None),
                [base, as_, name] if as_.eq_ignore_ascii_case("as") => (*base, Some((*name).to_owned())),
                _ => panic!("FROM {args}: expected `FROM <image> [AS <name>]`"),
            };
            stages.push(Stage {
                base: base.to_owned(),
                name,
                instructions: Vec::new(),
            });
            continue;
        }
        let stage = stages
            .last_mut()
            .unwrap_or_else(|| panic!("{keyword} before the first FROM"));
        stage.instructions.push(Instruction { keyword, args });
    }
    stages
}

/// An exec-form (JSON array) argument list, as ENTRYPOINT, CMD and HEALTHCHECK CMD take.
fn exec_form(text: &str) -> Vec<String> {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("`{text}` is not exec form (a JSON array of strings): {e}"))
}

/// A COPY: its `--from` stage (None: the build context), sources and destination.
#[derive(Debug)]
struct Copy {
    from: Option<String>,
    sources: Vec<String>,
    dest: String,
}

fn parse_copy(args: &str) -> Copy {
    let mut from = None;
    let mut paths = Vec::new();
    for word in shell_words(args) {
        if let Some(flag) = word.strip_prefix("--") {
            match flag.split_once('=') {
                Some(("from", stage)) => from = Some(stage.to_owned()),
                // Ownership and mode flags would change what the copy must hold: none are used.
                _ => panic!("COPY {args}: flag --{flag} is not understood by this test"),
            }
        } else {
            paths.push(word);
        }
    }
    let dest = paths.pop().expect("COPY has a destination");
    assert!(!paths.is_empty(), "COPY {args}: no source");
    Copy {
        from,
        sources: paths,
        dest,
    }
}

/// The repository's Dockerfile: the build stage and the runtime (last) stage.
struct Image {
    build: Stage,
    runtime: Stage,
}

fn image() -> Image {
    let text = fs::read_to_string(repo_path("Dockerfile")).expect("read the Dockerfile");
    let mut stages = parse_dockerfile(&text);
    assert_eq!(stages.len(), 2, "expected a build stage and a runtime stage");
    let runtime = stages.pop().unwrap();
    let build = stages.pop().unwrap();
    Image { build, runtime }
}

// ---------------------------------------------------------------------------------------------
// What the build stage leaves in /out, and the copy of the runtime stage's files.

/// An entry of the build stage's output tree.
enum Built {
    /// The release binary.
    Binary,
    /// A symbolic link with this target.
    Symlink(&'static str),
}

/// The build stage's `/out`, as its RUN makes it: each entry with the command that makes it,
/// which the Dockerfile must contain word for word (so this table cannot drift from it).
const BUILT: [(&str, Built, &str); 2] = [
    (
        "/out/usr/local/bin/tollgate",
        Built::Binary,
        "install -D -m 0755 target/release/tollgate /out/usr/local/bin/tollgate",
    ),
    (
        "/out/bin/ratelimit",
        Built::Symlink("/usr/local/bin/tollgate"),
        "ln -s /usr/local/bin/tollgate /out/bin/ratelimit",
    ),
];

/// The binary to run and whether it is a release build.
fn binary() -> (PathBuf, bool) {
    if let Some(path) = std::env::var_os("TOLLGATE_RELEASE_BIN").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "TOLLGATE_RELEASE_BIN={} is not a file", path.display());
        return (path, true);
    }
    let release = repo_path("target/release/tollgate");
    if release.is_file() {
        return (release, true);
    }
    assert!(
        !ci(),
        "CI=true: the image test runs the release binary; build it with `cargo build --release --locked \
         --bin tollgate` or set TOLLGATE_RELEASE_BIN"
    );
    eprintln!(
        "NOTE: no release binary (TOLLGATE_RELEASE_BIN unset, no target/release/tollgate): running the \
         test profile's binary instead"
    );
    (PathBuf::from(env!("CARGO_BIN_EXE_tollgate")), false)
}

/// `path` (absolute, as in the image) inside the copy at `root`.
fn inside(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

fn make_dirs(dir: &Path) {
    fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
}

/// Copies file or directory `from` to `to` (directories recursively; symlinks as symlinks).
fn copy_tree(from: &Path, to: &Path) {
    let meta = fs::symlink_metadata(from).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    if meta.file_type().is_symlink() {
        let target = fs::read_link(from).expect("read a symlink");
        std::os::unix::fs::symlink(target, to).expect("make a symlink");
    } else if meta.is_dir() {
        make_dirs(to);
        for entry in fs::read_dir(from).expect("read a directory") {
            let entry = entry.expect("a directory entry");
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        fs::copy(from, to).unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
    }
}

/// One `.dockerignore` line: its path segments and whether it is an exception (`!pattern`).
struct IgnorePattern {
    segments: Vec<String>,
    exception: bool,
}

/// The patterns of `.dockerignore`, in order. Docker's rules: `#` lines and blank lines are
/// skipped, a leading `/` and a trailing `/` mean nothing, `!` re-includes, and the last
/// pattern that matches a path decides.
fn dockerignore() -> Vec<IgnorePattern> {
    let text = fs::read_to_string(repo_path(".dockerignore")).expect("read .dockerignore");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|line| {
            let (exception, pattern) = match line.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, line),
            };
            let segments = pattern
                .split('/')
                .filter(|s| !s.is_empty() && *s != ".")
                .map(str::to_owned)
                .collect();
            IgnorePattern { segments, exception }
        })
        .collect()
}

/// Whether path segment `name` matches glob segment `glob` (`*` any run, `?` one character;
/// neither crosses a `/`, as in Go's filepath.Match, which Docker uses).
fn segment_matches(glob: &[u8], name: &[u8]) -> bool {
    match (glob.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => segment_matches(&glob[1..], name) || (!name.is_empty() && segment_matches(glob, &name[1..])),
        (Some(b'?'), Some(_)) => segment_matches(&glob[1..], &name[1..]),
        (Some(g), Some(n)) if g == n => segment_matches(&glob[1..], &name[1..]),
        _ => false,
    }
}

/// Whether the pattern's segments match the path's exactly (`**` spans any number of segments).
fn segments_match(glob: &[String], path: &[&str]) -> bool {
    match glob.first() {
        None => path.is_empty(),
        Some(g) if g == "**" => (0..=path.len()).any(|skip| segments_match(&glob[1..], &path[skip..])),
        Some(g) => {
            !path.is_empty()
                && segment_matches(g.as_bytes(), path[0].as_bytes())
                && segments_match(&glob[1..], &path[1..])
        }
    }
}

/// Whether `.dockerignore` keeps context path `path` (relative, `/`-separated) out of the build
/// context: the last pattern matching it or one of its parent directories decides.
fn docker_ignored_by(patterns: &[IgnorePattern], path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty() && *s != ".").collect();
    let mut ignored = false;
    for pattern in patterns {
        let hit = (1..=parts.len()).any(|n| segments_match(&pattern.segments, &parts[..n]));
        if hit {
            ignored = !pattern.exception;
        }
    }
    ignored
}

fn docker_ignored(path: &str) -> bool {
    docker_ignored_by(&dockerignore(), path)
}

/// Copies the build context, the repository minus what `.dockerignore` leaves out, to `to`.
/// A directory left out is not entered unless an exception pattern could re-include something
/// in it.
fn copy_build_context(to: &Path) {
    fn walk(patterns: &[IgnorePattern], relative: &str, to: &Path) {
        let dir = repo_path(relative);
        for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if relative.is_empty() {
                name
            } else {
                format!("{relative}/{name}")
            };
            let kind = entry.file_type().unwrap();
            let ignored = docker_ignored_by(patterns, &path);
            if kind.is_dir() {
                if ignored && !patterns.iter().any(|p| p.exception) {
                    continue;
                }
                walk(patterns, &path, to);
            } else if !ignored {
                let target = to.join(&path);
                make_dirs(target.parent().unwrap());
                copy_tree(&entry.path(), &target);
            }
        }
    }
    walk(&dockerignore(), "", to);
}

/// Drops the debug sections of the copied binary, as the build stage's
/// `CARGO_PROFILE_RELEASE_STRIP=debuginfo` does (symbols stay), when `strip` is installed; else
/// the copy keeps them, which changes its size but not what it runs.
fn strip_debuginfo(binary: &Path) {
    match Command::new("strip").arg("--strip-debug").arg(binary).status() {
        Ok(status) => assert!(status.success(), "strip --strip-debug {}: {status}", binary.display()),
        Err(e) => eprintln!("NOTE: no `strip` ({e}): the copied binary keeps its debug info"),
    }
}

/// Fills `root` with exactly what the runtime stage's COPY instructions put in the image.
fn build_copy(image: &Image, root: &Path, binary: &Path) {
    let build_name = image.build.name.as_deref().expect("the build stage is named");
    let build_run: String = image
        .build
        .all("RUN")
        .map(|i| i.args.clone())
        .collect::<Vec<_>>()
        .join("\n");
    let normalized_run = build_run.split_whitespace().collect::<Vec<_>>().join(" ");
    for (_, _, command) in &BUILT {
        assert!(
            normalized_run.contains(command),
            "the build stage no longer runs `{command}`: update BUILT in tests/suite/image.rs to what it makes"
        );
    }
    for copy in image.runtime.all("COPY").map(|i| parse_copy(&i.args)) {
        for source in &copy.sources {
            let dest_is_dir = copy.dest.ends_with('/');
            match copy.from.as_deref() {
                None => {
                    assert!(
                        !docker_ignored(source),
                        "COPY {source}: .dockerignore keeps it out of the build context"
                    );
                    let from = repo_path(source);
                    assert!(from.exists(), "COPY {source}: no such file in the repository");
                    let to = inside(root, &copy.dest);
                    if from.is_dir() {
                        // A directory's contents go into the destination.
                        copy_tree(&from, &to);
                    } else {
                        let to = if dest_is_dir {
                            to.join(from.file_name().unwrap())
                        } else {
                            to
                        };
                        make_dirs(to.parent().unwrap());
                        copy_tree(&from, &to);
                    }
                }
                Some(stage) => {
                    assert_eq!(stage, build_name, "COPY --from={stage}: not the build stage");
                    let prefix = source.trim_end_matches('/');
                    let mut matched = false;
                    for (path, built, _) in &BUILT {
                        let target = if *path == prefix {
                            // A file: to the destination, or into it when it ends with `/`.
                            let name = Path::new(path).file_name().unwrap().to_str().unwrap();
                            if dest_is_dir {
                                format!("{}{name}", copy.dest)
                            } else {
                                copy.dest.clone()
                            }
                        } else if let Some(rest) = path.strip_prefix(&format!("{prefix}/")) {
                            format!("{}/{rest}", copy.dest.trim_end_matches('/'))
                        } else {
                            continue;
                        };
                        matched = true;
                        let to = inside(root, &target);
                        make_dirs(to.parent().unwrap());
                        match built {
                            Built::Binary => {
                                fs::copy(binary, &to).expect("copy the binary");
                                fs::set_permissions(&to, fs::Permissions::from_mode(0o755)).unwrap();
                                strip_debuginfo(&to);
                            }
                            Built::Symlink(link) => std::os::unix::fs::symlink(link, &to).expect("make a symlink"),
                        }
                    }
                    assert!(
                        matched,
                        "COPY --from={stage} {source}: the build stage makes no such file"
                    );
                }
            }
        }
    }
}

/// Every file and symlink under `root`, as absolute image paths (symlinks with their target).
fn listing(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let name = format!("/{}", path.strip_prefix(root).unwrap().display());
            if meta.file_type().is_symlink() {
                out.push(format!("{name} -> {}", fs::read_link(&path).unwrap().display()));
            } else if meta.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(name);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// The copy of the image's files in a temporary directory every user may read (the copy is
/// root's, as COPY leaves it).
struct ImageCopy {
    dir: tempfile::TempDir,
    image: Image,
    release: bool,
}

impl ImageCopy {
    fn new() -> ImageCopy {
        let image = image();
        let (binary, release) = binary();
        let dir = tempfile::Builder::new()
            .prefix("tollgate-image.")
            .tempdir()
            .expect("a temporary directory");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let root = dir.path().join("root");
        make_dirs(&root);
        build_copy(&image, &root, &binary);
        // Everything readable, nothing writable but by root (which the mount makes read-only too).
        let status = Command::new("chmod")
            .args(["-R", "a+rX,go-w"])
            .arg(&root)
            .status()
            .unwrap();
        assert!(status.success());
        ImageCopy { dir, image, release }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn workdir(&self) -> String {
        self.image.runtime.last("WORKDIR").expect("a WORKDIR").args.clone()
    }

    fn user(&self) -> (u32, u32) {
        let user = &self.image.runtime.last("USER").expect("a USER").args;
        let (uid, gid) = user.split_once(':').expect("USER uid:gid");
        (uid.parse().expect("a numeric uid"), gid.parse().expect("a numeric gid"))
    }

    /// A command that runs `argv` (image paths, argv[0] as given) the way the image would: a
    /// private mount namespace where the copy and `/` are read-only, then as the image's USER
    /// with no supplementary groups, in its WORKDIR, with `env` only.
    ///
    /// The wrapper script first checks, as root and as that user, that nothing can be written
    /// (the root of the copy, its WORKDIR, and /tmp outside it): any write that succeeds exits
    /// 97 before the program starts.
    fn command(&self, argv: &[String], env: &BTreeMap<String, String>) -> Command {
        let root = self.root();
        let (uid, gid) = self.user();
        let program = argv.first().expect("a program");
        // The program's path in the copy, symlinks resolved inside the copy (an absolute
        // target means the image's root, as it would in the container).
        let mut resolved = program.clone();
        for _ in 0..8 {
            let path = inside(&root, &resolved);
            match fs::read_link(&path) {
                Ok(target) if target.is_absolute() => resolved = target.to_string_lossy().into_owned(),
                Ok(target) => {
                    let parent = Path::new(&resolved).parent().unwrap();
                    resolved = parent.join(target).to_string_lossy().into_owned();
                }
                Err(_) => break,
            }
        }
        let executable = inside(&root, &resolved);
        assert!(
            executable.is_file(),
            "{program} is not a file in the image (resolved: {resolved})"
        );
        let script = r#"
set -u
root=$1 workdir=$2 uid=$3 gid=$4 keep=$5
shift 5
/usr/bin/mount --bind "$root" "$root" || exit 96
/usr/bin/mount -o remount,bind,ro "$root" || exit 96
/usr/bin/mount -o remount,bind,ro / || exit 96
# A container's /tmp is its root filesystem's; a runner may have a tmpfs there.
if /usr/bin/mountpoint -q /tmp; then /usr/bin/mount -o remount,bind,ro /tmp || exit 96; fi
as_user() { /usr/bin/setpriv --reuid "$uid" --regid "$gid" --clear-groups -- "$@"; }
for target in "$root/.written-by-root" "/tmp/.tollgate-image-test-$$"; do
    if /usr/bin/touch "$target" 2>/dev/null; then echo "WRITABLE as root: $target"; exit 97; fi
done
for target in "$workdir/.written" "$root/.written" "/tmp/.tollgate-image-test-user-$$"; do
    if as_user /usr/bin/touch "$target" 2>/dev/null; then echo "WRITABLE as $uid: $target"; exit 97; fi
done
echo "read-only: writes as root and as $uid:$gid refused"
# In the WORKDIR, argv[0] as the image gives it, the executable from the copy, and only the
# image's environment (named in $keep: not what the shell or Python add, PWD, SHLVL, LC_CTYPE).
exec /usr/bin/setpriv --reuid "$uid" --regid "$gid" --clear-groups -- /usr/bin/python3 -c '
import os, sys
keep, workdir, argv0, exe = sys.argv[1:5]
os.chdir(workdir)
env = {k: os.environ[k] for k in keep.split(",") if k}
os.execve(exe, [argv0] + sys.argv[5:], env)
' "$keep" "$workdir" "$@"
"#;
        let mut command = Command::new("/usr/bin/unshare");
        command
            .args([
                "--mount",
                "--propagation",
                "private",
                "/bin/bash",
                "-c",
                script,
                "image",
            ])
            .arg(&root)
            .arg(inside(&root, &self.workdir()))
            .arg(uid.to_string())
            .arg(gid.to_string())
            .arg(env.keys().cloned().collect::<Vec<_>>().join(","))
            .arg(program)
            .arg(&executable)
            .args(&argv[1..])
            .env_clear()
            .envs(env);
        command
    }
}

/// The image's ENV plus `TOLLGATE_*` overrides putting the listeners on free loopback ports.
struct Ports {
    grpc: SocketAddr,
    http: SocketAddr,
    admin: SocketAddr,
}

impl Ports {
    fn new() -> Ports {
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ports {
            grpc: at(free_port()),
            http: at(free_port()),
            admin: at(free_port()),
        }
    }

    fn env(&self, image: &Image) -> BTreeMap<String, String> {
        let mut env = image.runtime.env();
        env.insert("TOLLGATE_GRPC_ADDR".into(), self.grpc.to_string());
        env.insert("TOLLGATE_HTTP_ADDR".into(), self.http.to_string());
        env.insert("TOLLGATE_ADMIN__ADDR".into(), self.admin.to_string());
        env
    }
}

fn require_root(test: &str) -> bool {
    let uid = Command::new("id").arg("-u").output().expect("run id");
    let root = String::from_utf8_lossy(&uid.stdout).trim() == "0";
    if !root {
        assert!(!ci(), "{test}: needs root (a mount namespace, setpriv) and CI=true");
        eprintln!("SKIPPED {test}: needs root for unshare --mount and setpriv");
    }
    root
}

/// Starts the image's ENTRYPOINT (+ CMD) from the copy, or `argv` instead, and waits until
/// `/readyz` answers 200 on its HTTP port.
fn start(copy: &ImageCopy, ports: &Ports, argv: Option<Vec<String>>, extra_env: &[(&str, String)]) -> ChildGuard {
    let mut argv = argv.unwrap_or_else(|| {
        let mut argv = exec_form(&copy.image.runtime.last("ENTRYPOINT").expect("an ENTRYPOINT").args);
        if let Some(cmd) = copy.image.runtime.last("CMD") {
            argv.extend(exec_form(&cmd.args));
        }
        argv
    });
    let mut env = ports.env(&copy.image);
    env.extend(extra_env.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let mut command = copy.command(&argv, &env);
    let name = Path::new(&argv.remove(0))
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut process = ChildGuard::spawn(&name, &mut command, &copy.dir.path().join(format!("{name}.log")));
    let http = ports.http;
    wait_until(&mut process, || {
        http_get(http, "/readyz").filter(|(status, _)| *status == 200)
    })
    .unwrap_or_else(|why| {
        panic!(
            "{name} from the image copy did not get ready: {why}\n{}",
            process.log_tail(40)
        )
    });
    process
}

// ---------------------------------------------------------------------------------------------

#[test]
fn hadolint_accepts_the_dockerfile() {
    let Some(hadolint) = support::tools::tool_or_skip("hadolint_accepts_the_dockerfile", "hadolint") else {
        return;
    };
    let out = Command::new(hadolint)
        .arg(repo_path("Dockerfile"))
        .output()
        .expect("run hadolint");
    assert!(
        out.status.success(),
        "hadolint Dockerfile:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The layout other parts rely on (deploy/, docs, the envoyproxy/ratelimit drop-in), and the
/// stages' choices, read from the Dockerfile.
#[test]
#[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
fn dockerfile_has_the_documented_layout() {
    let image = image();
    assert_eq!(image.build.base, "rust:1.95-bookworm");
    let run: String = image
        .build
        .all("RUN")
        .map(|i| i.args.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(run.contains("cargo build --release --locked"), "{run}");
    // Without the debug line tables of the release profile (~94 MB of the binary).
    assert!(
        run.contains("CARGO_PROFILE_RELEASE_STRIP=debuginfo cargo build --release"),
        "the build stage strips debug info: {run}"
    );
    assert_eq!(image.runtime.base, "gcr.io/distroless/cc-debian12:nonroot");
    assert_eq!(image.runtime.last("WORKDIR").unwrap().args, "/srv/tollgate");
    assert_eq!(image.runtime.last("USER").unwrap().args, "65534:65534");
    assert_eq!(
        exec_form(&image.runtime.last("ENTRYPOINT").unwrap().args),
        ["/usr/local/bin/tollgate", "serve"]
    );
    assert!(
        image.runtime.last("CMD").is_none(),
        "no CMD: `docker run tollgate` is `tollgate serve`"
    );

    // The exposed ports are the baked-in settings' gRPC and HTTP ports.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    build_copy(&image, root, Path::new(env!("CARGO_BIN_EXE_tollgate")));
    let exposed: Vec<u16> = image
        .runtime
        .all("EXPOSE")
        .flat_map(|i| i.args.split_whitespace().map(|p| p.parse().expect("a port number")))
        .collect();
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in image.runtime.env() {
            jail.set_env(k, v);
        }
        let settings =
            tollgate::server::settings::Settings::load(Some(&inside(root, "/srv/tollgate/config/tollgate.yaml")))
                .map_err(|e| e.to_string())?;
        settings.validate()?;
        assert_eq!(
            exposed,
            [
                settings.grpc_addr.tcp().expect("a TCP gRPC address").port(),
                settings.http_addr.port()
            ]
        );
        assert!(
            settings.admin.addr.ip().is_loopback(),
            "the admin API must stay inside the container"
        );
        assert_eq!(settings.rules, Path::new("config/rules"), "relative to the WORKDIR");
        // Every ENV of the image is a setting (a misspelt one would be ignored silently).
        assert_eq!(tollgate::server::settings::unknown_env_vars(), Vec::<String>::new());
        assert_eq!(settings.log.format, tollgate::server::settings::LogFormat::Json);
        Ok(())
    });

    // Exactly these files: the binary once, its second name, the example settings and rules.
    let mut expected = vec![
        "/bin/ratelimit -> /usr/local/bin/tollgate".to_owned(),
        "/srv/tollgate/config/tollgate.yaml".to_owned(),
        "/usr/local/bin/tollgate".to_owned(),
    ];
    for entry in fs::read_dir(repo_path("config/rules")).unwrap() {
        let name = entry.unwrap().file_name();
        expected.push(format!("/srv/tollgate/config/rules/{}", name.to_string_lossy()));
    }
    expected.sort();
    assert_eq!(listing(root), expected);

    // The health check is `tollgate probe` on the HTTP port's liveness path: orchestrators that
    // restart unhealthy containers must not restart them all while a backend is down (which
    // `/readyz` reports).
    let health = &image.runtime.last("HEALTHCHECK").expect("a HEALTHCHECK").args;
    let cmd = health.split_once("CMD ").expect("HEALTHCHECK ... CMD [...]").1;
    assert_eq!(
        exec_form(cmd),
        ["/usr/local/bin/tollgate", "probe", "http://127.0.0.1:8080/healthz"]
    );
}

/// The build context as `.dockerignore` leaves it, copied to a temporary directory: the big
/// and unrelated directories are out, cargo reads the manifest, lock file and every target the
/// manifest declares from it (`cargo metadata --locked --offline`), the build stage's COPY
/// sources are in it, and every file src/ embeds (`include_str!`, `include_bytes!`,
/// `sqlx::migrate!`) is in it.
#[test]
fn dockerignore_keeps_the_build_context_small_but_complete() {
    for ignored in ["target/", ".git", "tests/", "docs/", "target/release/tollgate"] {
        assert!(docker_ignored(ignored), "{ignored} should not be sent to the builder");
    }
    let context = tempfile::tempdir().unwrap();
    let root = context.path();
    copy_build_context(root);
    for absent in ["target", "tests", "docs", ".git"] {
        assert!(!root.join(absent).exists(), "{absent} is in the build context");
    }

    // cargo checks every target the manifest names (bins, benches, examples) against the files.
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--locked",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(root)
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata in the build context:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    let targets = metadata["packages"][0]["targets"].as_array().expect("targets");
    for target in targets {
        let src = Path::new(target["src_path"].as_str().unwrap());
        assert!(
            src.starts_with(root) && src.is_file(),
            "target source {} is not in the build context",
            src.display()
        );
    }
    // cargo metadata drops a declared target whose file is missing, where `cargo build` fails:
    // every `[[bin]]`, `[[bench]]`, `[[example]]` and `[[test]]` of the manifest must be listed.
    let manifest = fs::read_to_string(repo_path("Cargo.toml")).unwrap();
    let mut section = "";
    let mut declared = 0;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let kind = match section {
            "[[bin]]" => "bin",
            "[[bench]]" => "bench",
            "[[example]]" => "example",
            "[[test]]" => "test",
            _ => continue,
        };
        let Some(name) = line
            .strip_prefix("name")
            .map(|r| r.trim_start().trim_start_matches('=').trim().trim_matches('"'))
        else {
            continue;
        };
        declared += 1;
        assert!(
            targets
                .iter()
                .any(|t| t["name"] == name && t["kind"].as_array().unwrap().iter().any(|k| k == kind)),
            "Cargo.toml declares the {kind} {name}, whose source is not in the build context"
        );
    }
    assert!(declared > 0, "Cargo.toml declares its binaries and benches");

    let image = image();
    for copy in image.build.all("COPY").map(|i| parse_copy(&i.args)) {
        if copy.from.is_some() {
            continue;
        }
        for source in &copy.sources {
            assert!(
                root.join(source).exists(),
                "the build stage copies {source}, which is not in the build context"
            );
        }
    }

    // What the sources embed at compile time.
    let mut embedded = Vec::new();
    let mut sources = vec![repo_path("src")];
    while let Some(dir) = sources.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let text = fs::read_to_string(&path).unwrap();
            let relative_dir = path.parent().unwrap().strip_prefix(repo_path("")).unwrap().to_owned();
            for (mac, from_manifest) in [
                ("include_str!(\"", false),
                ("include_bytes!(\"", false),
                ("sqlx::migrate!(\"", true),
            ] {
                for (at, _) in text.match_indices(mac) {
                    let arg = &text[at + mac.len()..];
                    let arg = &arg[..arg.find('"').unwrap()];
                    let base = if from_manifest {
                        PathBuf::new()
                    } else {
                        relative_dir.clone()
                    };
                    embedded.push((path.clone(), base.join(arg)));
                }
            }
        }
    }
    assert!(!embedded.is_empty(), "src/ embeds the Lua scripts and the migrations");
    for (file, target) in embedded {
        let in_context = root.join(&target);
        assert!(
            in_context.exists()
                && fs::canonicalize(&in_context)
                    .unwrap()
                    .starts_with(fs::canonicalize(root).unwrap()),
            "{} embeds {}, which is not in the build context",
            file.display(),
            target.display()
        );
    }
}

/// Acceptance 1: the binary run as the image runs it serves, reports healthy through the
/// image's own HEALTHCHECK command, and real Envoy limits traffic through it with the shipped
/// demo bootstrap and the rules baked into the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_copy_runs_read_only_as_nobody_and_envoy_limits_through_it() {
    let test = "image_copy_runs_read_only_as_nobody_and_envoy_limits_through_it";
    if !require_root(test) {
        return;
    }
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let copy = ImageCopy::new();
    eprintln!(
        "image copy with a {} binary",
        if copy.release { "release" } else { "debug" }
    );
    let ports = Ports::new();
    let mut tollgate = tokio::task::block_in_place(|| start(&copy, &ports, None, &[]));
    let log = tollgate.log();
    assert!(
        log.contains("read-only: writes as root and as 65534:65534 refused"),
        "{log}"
    );

    // The process runs as nobody, in the WORKDIR, with the image's environment only.
    let pid = tollgate_pid(&tollgate);
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    for key in ["Uid:", "Gid:"] {
        let line = status.lines().find(|l| l.starts_with(key)).unwrap();
        assert!(line.split_whitespace().skip(1).all(|id| id == "65534"), "{line}");
    }
    let groups = status.lines().find(|l| l.starts_with("Groups:")).unwrap();
    assert_eq!(groups.trim(), "Groups:", "no supplementary groups");
    let cwd = fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
    assert_eq!(cwd, inside(&copy.root(), "/srv/tollgate"));
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
    let mut names: Vec<String> = environ
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| String::from_utf8_lossy(e).split('=').next().unwrap().to_owned())
        .collect();
    names.sort();
    let mut expected: Vec<String> = ports.env(&copy.image).into_keys().collect();
    expected.sort();
    assert_eq!(names, expected);
    // JSON log lines, as the image's ENV asks.
    let json_line = log
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON log line:\n{log}"));
    serde_json::from_str::<serde_json::Value>(json_line).expect("a JSON log line");

    // The image's HEALTHCHECK, run the same way (its port moved to the test's).
    let health = &copy.image.runtime.last("HEALTHCHECK").unwrap().args;
    let mut probe = exec_form(health.split_once("CMD ").unwrap().1);
    let url = probe.pop().unwrap().replace("127.0.0.1:8080", &ports.http.to_string());
    probe.push(url);
    let out = tokio::task::block_in_place(|| copy.command(&probe, &ports.env(&copy.image)).output().unwrap());
    assert!(out.status.success(), "{out:?}");
    let mut broken = probe.clone();
    *broken.last_mut().unwrap() = format!("http://{}/no-such-path", ports.http);
    let out = tokio::task::block_in_place(|| copy.command(&broken, &ports.env(&copy.image)).output().unwrap());
    assert_eq!(out.status.code(), Some(1), "probe of a 404: {out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("404"), "{out:?}");

    // Envoy with the shipped demo bootstrap, in front of an upstream, asking this tollgate.
    let upstream = start_upstream().await;
    let demo = fs::read_to_string(repo_path("envoy/envoy.yaml")).expect("read envoy/envoy.yaml");
    let mut bootstrap = demo.clone();
    for (from, to) in [
        (
            "{ address: 0.0.0.0, port_value: 10000 }".to_owned(),
            "{ address: 127.0.0.1, port_value: 0 }".to_owned(),
        ),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        (
            "port_value: 8000".to_owned(),
            format!("port_value: {}", upstream.port()),
        ),
        (
            "port_value: 8081".to_owned(),
            format!("port_value: {}", ports.grpc.port()),
        ),
        // A debug build on a busy machine: a late answer would fail open.
        ("timeout: 0.1s".to_owned(), "timeout: 2s".to_owned()),
    ] {
        assert_eq!(
            demo.matches(&from).count(),
            1,
            "envoy/envoy.yaml changed: expected `{from}` once"
        );
        bootstrap = bootstrap.replace(&from, &to);
    }
    let envoy = tokio::task::block_in_place(|| Envoy::start(&envoy_bin, &bootstrap));
    let url = format!("http://{}/upload", envoy.listener("ingress"));
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // config/rules/example.yaml, baked into the image: uploads_per_key has capacity 5, one
    // more every 12 s.
    let start = Instant::now();
    for n in 1..=5 {
        let reply = client.get(&url).header("x-api-key", "image").send().await.unwrap();
        assert_eq!(reply.status(), 200, "upload {n}: {:?}", reply.headers());
        assert_eq!(reply.headers()["x-upstream"], "yes");
    }
    let denied = client.get(&url).header("x-api-key", "image").send().await.unwrap();
    assert_eq!(denied.status(), 429, "{:?}", denied.headers());
    assert_eq!(denied.headers()["x-envoy-ratelimited"], "true");
    let retry_after: u64 = denied.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let elapsed = start.elapsed().as_secs();
    assert!(
        (12 - elapsed.min(12)..=12).contains(&retry_after),
        "retry-after {retry_after} after {elapsed} s"
    );
    tokio::task::block_in_place(|| {
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.over_limit"), 1);
        assert_eq!(envoy.stat("cluster.upstream.ratelimit.error"), 0);
    });
    assert!(
        tollgate.exited().is_none(),
        "tollgate exited:\n{}",
        tollgate.log_tail(40)
    );
}

/// The image's second name: `/bin/ratelimit` (envoyproxy/ratelimit's command) starts the same
/// binary as `tollgate serve` (the binary serves when its file name is `ratelimit`, with no
/// arguments, as their manifests run it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_copy_serves_under_the_name_bin_ratelimit() {
    let test = "image_copy_serves_under_the_name_bin_ratelimit";
    if !require_root(test) {
        return;
    }
    let copy = ImageCopy::new();
    let ports = Ports::new();
    // Their manifests mount the rules (a ConfigMap) at $RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/config
    // and set those variables, as Istio's sample does; the mount lies outside the image's files.
    let mount = tempfile::tempdir().expect("a temp dir for the rules mount");
    let config = mount.path().join("data/ratelimit/config");
    fs::create_dir_all(&config).unwrap();
    fs::write(
        config.join("config.yaml"),
        "domain: ratelimit\ndescriptors:\n  - key: PATH\n    value: /productpage\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    .unwrap();
    // Readable by 65534, as a mounted volume is.
    for dir in [
        mount.path().to_owned(),
        mount.path().join("data"),
        mount.path().join("data/ratelimit"),
        config.clone(),
    ] {
        fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let env = [
        ("RUNTIME_ROOT", mount.path().join("data").to_string_lossy().into_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("LOG_LEVEL", "debug".to_owned()),
    ];
    let mut process = tokio::task::block_in_place(|| start(&copy, &ports, Some(vec!["/bin/ratelimit".into()]), &env));
    let pid = tollgate_pid(&process);
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert_eq!(cmdline, b"/bin/ratelimit\0");
    assert_eq!(http_get(ports.http, "/healthz").map(|(s, _)| s), Some(200));
    // Their health check, and the rules from the mount (not the image's baked-in example).
    let (status, body) = http_get(ports.http, "/healthcheck").expect("/healthcheck answers");
    assert_eq!((status, body.trim()), (200, "OK"));
    let (status, config) = http_get(ports.admin, "/config").expect("/config answers on the admin listener");
    assert_eq!(status, 200);
    assert!(
        config.contains("/productpage"),
        "the mounted rules are not in force: {config}"
    );
    assert!(
        !config.contains("uploads_per_key"),
        "the image's example rules were loaded: {config}"
    );
    assert!(process.exited().is_none());
}

/// The pid of the served binary: the wrapper (unshare, bash, setpriv, python3) execs into it, so
/// the child's pid is it once it answers.
fn tollgate_pid(process: &ChildGuard) -> u32 {
    let pid = process.id();
    let exe = fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert!(
        exe.ends_with("usr/local/bin/tollgate"),
        "the child process is {} (the wrapper should have exec'd the binary from the copy)",
        exe.display()
    );
    pid
}

/// An upstream on a free loopback port that answers every request 200 with `x-upstream: yes`.
async fn start_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the upstream");
    let addr = listener.local_addr().expect("upstream address");
    let app = axum::Router::new().fallback(|| async { ([("x-upstream", "yes")], "hello from upstream\n") });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream server") });
    addr
}
