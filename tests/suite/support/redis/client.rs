//! A blocking RESP2 client: one command or a connection, the replies as values, and the
//! server introspection tests read (`INFO`, `INFO commandstats`, the pid).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::*;

/// How long [`resp_command`] waits to connect and for each reply.
pub const RESP_TIMEOUT: Duration = Duration::from_secs(2);

/// One RESP2 reply.
#[derive(Clone, Debug, PartialEq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`: the server refused the command.
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$3\r\nabc`
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`
    Nil,
    /// `*2\r\n...`
    Array(Vec<RespValue>),
}

impl RespValue {
    /// The bytes of a bulk or simple string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            RespValue::Bulk(b) => Some(b),
            RespValue::Simple(s) => Some(s.as_bytes()),
            _ => None,
        }
    }

    /// A bulk or simple string as text (invalid UTF-8 replaced).
    pub fn as_text(&self) -> Option<String> {
        self.as_bytes().map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// An integer reply, or a string reply holding an integer.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Integer(i) => Some(*i),
            other => std::str::from_utf8(other.as_bytes()?).ok()?.parse().ok(),
        }
    }

    /// The elements of an array reply.
    pub fn as_array(&self) -> Option<&[RespValue]> {
        match self {
            RespValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// `Err` with the message for an error reply, `Ok(self)` otherwise.
    pub fn ok(self) -> Result<RespValue, String> {
        match self {
            RespValue::Error(e) => Err(e),
            other => Ok(other),
        }
    }
}

/// One command to `addr` on a fresh connection (logging in with `password` first when given),
/// waiting at most [`RESP_TIMEOUT`] to connect and for each reply. `Err` for a network or
/// protocol failure (a stopped server times out) or a failed login; a command the server
/// refuses is `Ok(RespValue::Error)`.
pub fn resp_command(addr: SocketAddr, password: Option<&str>, args: &[&[u8]]) -> Result<RespValue, String> {
    resp_command_timeout(addr, password, args, RESP_TIMEOUT)
}

/// [`resp_command`] with its own timeout.
pub fn resp_command_timeout(
    addr: SocketAddr,
    password: Option<&str>,
    args: &[&[u8]],
    timeout: Duration,
) -> Result<RespValue, String> {
    let target = RedisTarget {
        addr,
        username: None,
        password: password.map(str::to_owned),
    };
    target.command_timeout(args, timeout)
}

/// A blocking RESP2 connection.
pub struct RespConn {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
}

impl RespConn {
    /// Connects to `target` and logs in (`AUTH [user] password`) when it has a password.
    pub fn connect(target: &RedisTarget, timeout: Duration) -> Result<RespConn, String> {
        let addr = target.addr;
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| format!("{addr}: {e}"))?;
        let mut conn = RespConn {
            addr,
            reader: BufReader::new(stream),
        };
        if let Some(password) = &target.password {
            let reply = match &target.username {
                Some(user) => conn.command(&[b"AUTH", user.as_bytes(), password.as_bytes()])?,
                None => conn.command(&[b"AUTH", password.as_bytes()])?,
            };
            if let RespValue::Error(e) = reply {
                return Err(format!("AUTH on {addr}: {e}"));
            }
        }
        Ok(conn)
    }

    /// Sends one command and reads its reply.
    pub fn command(&mut self, args: &[&[u8]]) -> Result<RespValue, String> {
        let mut replies = self.pipeline(&[args.iter().map(|a| a.to_vec()).collect()])?;
        Ok(replies.remove(0))
    }

    /// Sends all `commands` at once, then reads one reply for each.
    pub fn pipeline(&mut self, commands: &[Vec<Vec<u8>>]) -> Result<Vec<RespValue>, String> {
        let mut out = Vec::new();
        for args in commands {
            out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for arg in args {
                out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                out.extend_from_slice(arg);
                out.extend_from_slice(b"\r\n");
            }
        }
        let addr = self.addr;
        self.reader
            .get_mut()
            .write_all(&out)
            .map_err(|e| format!("write to {addr}: {e}"))?;
        (0..commands.len())
            .map(|_| read_value(&mut self.reader).map_err(|e| format!("read from {addr}: {e}")))
            .collect()
    }
}

fn read_line(reader: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line).map_err(|e| e.to_string())?;
    if line.is_empty() {
        return Err("connection closed".to_owned());
    }
    if !line.ends_with(b"\r\n") {
        return Err(format!("truncated line {:?}", String::from_utf8_lossy(&line)));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn read_value(reader: &mut impl BufRead) -> Result<RespValue, String> {
    let line = read_line(reader)?;
    let (kind, rest) = line.split_first().ok_or("empty reply line")?;
    let text = String::from_utf8_lossy(rest).into_owned();
    let number = || {
        text.parse::<i64>()
            .map_err(|_| format!("bad length or integer {text:?}"))
    };
    match kind {
        b'+' => Ok(RespValue::Simple(text.clone())),
        b'-' => Ok(RespValue::Error(text.clone())),
        b':' => Ok(RespValue::Integer(number()?)),
        b'$' => {
            let len = number()?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            let mut data = vec![0; len as usize + 2];
            reader.read_exact(&mut data).map_err(|e| e.to_string())?;
            if !data.ends_with(b"\r\n") {
                return Err("bulk string not followed by CRLF".to_owned());
            }
            data.truncate(len as usize);
            Ok(RespValue::Bulk(data))
        }
        b'*' => {
            let len = number()?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            (0..len)
                .map(|_| read_value(reader))
                .collect::<Result<_, _>>()
                .map(RespValue::Array)
        }
        other => Err(format!(
            "unknown reply type {:?} in {:?}",
            *other as char,
            String::from_utf8_lossy(&line)
        )),
    }
}

/// `INFO <section>` as text.
pub fn info(target: impl Into<RedisTarget>, section: &str) -> String {
    target
        .into()
        .cmd(&[b"INFO", section.as_bytes()])
        .as_text()
        .expect("INFO answers a bulk string")
}

/// `INFO commandstats` per command (lower case, `client|setname` for subcommands): the number of
/// calls and the total microseconds spent in them.
pub fn info_commandstats(target: impl Into<RedisTarget>) -> HashMap<String, (u64, f64)> {
    parse_commandstats(&info(target, "commandstats"))
}

/// Parses lines like `cmdstat_evalsha:calls=3,usec=45,usec_per_call=15.00,...`.
pub fn parse_commandstats(text: &str) -> HashMap<String, (u64, f64)> {
    text.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |key: &str| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
                    .map(str::to_owned)
            };
            let calls = field("calls")?.parse().ok()?;
            let usec = field("usec")?.parse().ok()?;
            Some((name.to_owned(), (calls, usec)))
        })
        .collect()
}

/// The server's process id (`process_id` in `INFO server`), e.g. to read its CPU time from
/// `/proc/<pid>/stat`.
pub fn redis_server_pid(target: impl Into<RedisTarget>) -> u32 {
    let text = info(target, "server");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("process_id:")?.parse().ok())
        .unwrap_or_else(|| panic!("no process_id in INFO server:\n{text}"))
}
