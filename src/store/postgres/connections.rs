//! The decision lanes' connections ([`super::batch`]): each lane owns one, opened directly
//! (not through a pool) and kept from batch to batch.
//!
//! Why not a pool: a pool tests a connection when it is taken and when it is given back, two
//! round trips a batch would pay besides its own one; and sqlx's pool, refused while a server
//! is down or starting up, retries with a back-off that grows to a fifth of its timeout and
//! holds a connection slot while it sleeps, so requests well after PostgreSQL was back waited
//! out their whole budget for a connection. A lane opens its own at once when it needs one,
//! and gives up at once when refused: spacing attempts during an outage is the circuit
//! breaker's job.
//!
//! Getting a connection runs on a task of its own ([`Connections::renew`]), beside the lane, so
//! it never holds up a request that has one, and a handshake a request stopped waiting for is
//! not wasted. A lane without a connection keeps trying in the background, 50 ms to a second
//! apart, so it is connected soon after PostgreSQL is back; a request that comes to it
//! meanwhile starts an attempt at once and waits for it within its own budget. While other
//! lanes have a connection, a lane without one leaves the requests to them. A connection whose
//! statement timed out is only in doubt: it is checked in the background, and kept if it
//! answers, so a slow server does not get a new session for every timeout.
//!
//! A kept connection can die unseen (PostgreSQL restarted, a failover). The first lane to find
//! its connection broken counts a *break*; every lane watches the count and then checks its own
//! connection (one round trip) and replaces it if it is dead, in the background. A break only
//! asks for a check, not a new connection, so a batch that timed out under load does not make
//! every lane pay a handshake.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;
use tokio::sync::watch;
use tokio::time::Instant;

use super::store_error;
use crate::store::StoreError;

/// A connection unused for longer than this is pinged before a batch goes on it: with so little
/// load a round trip costs nothing, and a connection that died quietly fails no request.
pub(super) const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Where lanes get their connections.
pub(crate) struct Connections {
    options: PgConnectOptions,
    /// `postgres.connect_timeout_ms`: the most one attempt may take.
    connect_timeout: Duration,
    /// Opened ahead ([`Connections::warm`]) for lanes to take without a handshake.
    spare: Mutex<Vec<Spare>>,
    /// How many connections lanes hold or are opening now (kept by [`Slot`]'s drop).
    holding: Arc<AtomicUsize>,
    /// How many kept connections were found broken so far.
    breaks: watch::Sender<u64>,
}

/// A connection opened ahead, with when and at which break count.
struct Spare {
    conn: PgConnection,
    since: Instant,
    breaks: u64,
}

/// A lane's connection.
pub(super) struct Held {
    pub conn: PgConnection,
    /// The break count when it was opened: a later break makes it suspect.
    pub breaks: u64,
    /// When it last served (or was opened).
    pub used: Instant,
    _slot: Slot,
}

/// One count in [`Connections::holding`], from the start of an attempt to open a connection
/// until that attempt fails or is dropped, or the connection it opened is closed.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(holding: &Arc<AtomicUsize>) -> Slot {
        holding.fetch_add(1, Ordering::AcqRel);
        Slot(holding.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Connections {
    /// Connections made with `options`, each attempt given at most `connect_timeout`.
    pub(crate) fn new(options: PgConnectOptions, connect_timeout: Duration) -> Connections {
        Connections {
            options,
            connect_timeout,
            spare: Mutex::new(Vec::new()),
            holding: Arc::new(AtomicUsize::new(0)),
            breaks: watch::channel(0).0,
        }
    }

    /// Opens connections until `lanes` are held or spare, all at once, so the first decisions
    /// do not pay for a handshake (SCRAM costs milliseconds of key derivation).
    ///
    /// Errors: the first attempt that failed (refused, authentication, timeout).
    pub(crate) async fn warm(&self, lanes: usize) -> Result<(), StoreError> {
        let have = self.holding.load(Ordering::Acquire) + self.spare.lock().expect("spare lock").len();
        let opened = futures_util::future::join_all((have..lanes).map(|_| self.connect())).await;
        let mut failed = None;
        let mut spare = self.spare.lock().expect("spare lock");
        for c in opened {
            match c {
                // Lanes may have opened their own meanwhile: never more than `lanes` in all.
                Ok(conn) if self.holding.load(Ordering::Acquire) + spare.len() < lanes => spare.push(Spare {
                    conn,
                    since: Instant::now(),
                    breaks: *self.breaks.borrow(),
                }),
                Ok(_) => {}
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// A connection for a lane: a spare one (checked first if it waited past [`IDLE_CHECK`]
    /// or a break came since it was opened), else a new one.
    ///
    /// Errors: PostgreSQL refused it, or did not answer within `connect_timeout`.
    pub(super) async fn open(&self) -> Result<Held, StoreError> {
        // Counted from now, so that `warm` running meanwhile does not open one more.
        let slot = Slot::take(&self.holding);
        let breaks = *self.breaks.borrow();
        let conn = loop {
            let spare = self.spare.lock().expect("spare lock").pop();
            match spare {
                Some(mut s) => {
                    if (s.since.elapsed() <= IDLE_CHECK && s.breaks == breaks) || self.check(&mut s.conn).await {
                        break s.conn;
                    }
                }
                None => break self.connect().await?,
            }
        };
        Ok(Held {
            conn,
            breaks,
            used: Instant::now(),
            _slot: slot,
        })
    }

    /// How many lanes hold a connection or are opening one.
    pub(super) fn holding(&self) -> usize {
        self.holding.load(Ordering::Acquire)
    }

    async fn connect(&self) -> Result<PgConnection, StoreError> {
        match tokio::time::timeout(self.connect_timeout, PgConnection::connect_with(&self.options)).await {
            Ok(connected) => connected.map_err(store_error),
            Err(_) => Err(StoreError::Timeout(
                format!(
                    "no connection to Postgres within {} ms",
                    self.connect_timeout.as_millis()
                )
                .into(),
            )),
        }
    }

    /// Whether `conn` still answers, within `connect_timeout`. After a statement abandoned at
    /// its deadline, sqlx first reads what that statement still had to say (PostgreSQL cancels
    /// it at its `statement_timeout`, the same budget), so a slow server's connection is kept.
    pub(super) async fn check(&self, conn: &mut PgConnection) -> bool {
        let check = async {
            // The abandoned statement's own error (57014, the statement timeout) comes back
            // first, as the first ping's answer: the session goes on, so ask again.
            for _ in 0..2 {
                match conn.ping().await {
                    Ok(()) => return true,
                    Err(sqlx::Error::Database(d)) if !session_ended(d.as_ref()) => continue,
                    Err(_) => return false,
                }
            }
            false
        };
        tokio::time::timeout(self.connect_timeout, check).await.unwrap_or(false)
    }

    /// A lane found its connection broken, or gave up on it in the middle of a statement:
    /// every other connection is suspect until checked.
    pub(super) fn broke(&self) {
        self.breaks.send_modify(|n| *n += 1);
    }

    /// The break count, to watch.
    pub(super) fn breaks(&self) -> watch::Receiver<u64> {
        self.breaks.subscribe()
    }

    /// Starts getting a lane a connection in the background, after `delay`: checks `suspect`
    /// (a connection a break elsewhere made suspect, or the lane's own after a failed or
    /// abandoned statement) and keeps it if it answers, else opens one; a dead one counts a
    /// break when `own_failure` (the other lanes then check theirs). Runs on its own task, so a
    /// request that stops waiting for it at its deadline does not waste the handshake.
    pub(super) fn renew(self: &Arc<Self>, suspect: Option<Held>, delay: Duration, own_failure: bool) -> Renewal {
        let this = self.clone();
        let starts = Instant::now() + delay;
        let task = tokio::spawn(async move {
            tokio::time::sleep_until(starts).await;
            if let Some(mut h) = suspect {
                let seen = *this.breaks.borrow();
                if this.check(&mut h.conn).await {
                    h.breaks = seen;
                    h.used = Instant::now();
                    return Ok(h);
                }
                drop(h);
                if own_failure {
                    this.broke();
                }
            }
            this.open().await
        });
        Renewal { task, starts }
    }
}

/// A connection being got for a lane ([`Connections::renew`]); dropping it stops the attempt.
pub(super) struct Renewal {
    task: tokio::task::JoinHandle<Result<Held, StoreError>>,
    starts: Instant,
}

impl Renewal {
    /// Whether it is still waiting out its delay (a back-off after failed attempts).
    pub(super) fn waiting(&self) -> bool {
        Instant::now() < self.starts
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The connection `renewal` got, once it has; never ready when there is none. Cancel-safe: the
/// attempt goes on when the caller stops waiting. Set `renewal` to `None` once this returns.
pub(super) async fn renewed(renewal: &mut Option<Renewal>) -> Result<Held, StoreError> {
    match renewal {
        Some(r) => match (&mut r.task).await {
            Ok(got) => got,
            Err(e) => Err(StoreError::Unavailable(
                format!("opening a connection failed: {e}").into(),
            )),
        },
        None => std::future::pending().await,
    }
}

/// The delay before a lane's next attempt after one failed: 50 ms, doubling up to a second.
/// Attempts go on in the background during an outage, so a lane is connected soon after
/// PostgreSQL is back; a request that comes meanwhile does not wait for the delay.
pub(super) fn back_off(previous: Duration) -> Duration {
    (previous * 2).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Whether an error PostgreSQL sent says it ended the session: a `FATAL` or `PANIC` one, class
/// 08 (connection exception), or 57P01 to 57P03 (the server shutting down, crashed, or not yet
/// accepting connections: a fast shutdown or `pg_terminate_backend` sends 57P01 before it
/// closes the socket). Codes from PostgreSQL's Appendix A, "PostgreSQL Error Codes".
pub(super) fn session_ended(d: &dyn sqlx::error::DatabaseError) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    let fatal = d
        .try_downcast_ref::<PgDatabaseError>()
        .is_some_and(|p| matches!(p.severity(), PgSeverity::Fatal | PgSeverity::Panic));
    let code = d.code();
    let code = code.as_deref().unwrap_or("");
    fatal || code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03")
}
