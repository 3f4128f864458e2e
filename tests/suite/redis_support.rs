//! The Redis test infrastructure itself (`tests/suite/support/redis/`): private servers that start,
//! die, come back on the same port and pause; passwords; SCAN for keys without a TTL over keys
//! of arbitrary bytes; `INFO` parsing; the shared server; a three-master cluster.

use crate::support;

use std::time::{Duration, Instant};

use support::redis::{
    info_commandstats, keys_without_ttl, keys_without_ttl_raw, parse_commandstats, redis_server_pid, resp_command,
    resp_command_timeout, scan_pattern, shared_redis, unique_prefix, RedisCluster, RedisServer, RedisTarget, RespValue,
};

fn pong() -> RespValue {
    RespValue::Simple("PONG".into())
}

#[test]
fn a_private_server_starts_dies_restarts_on_the_same_port_and_pauses() {
    let mut server = RedisServer::start();
    let port = server.port();
    assert_eq!(server.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(server.auth_url(), server.url());
    assert!(server.ping());
    assert_eq!(server.cli(&["set", "k", "v"]), "OK");
    assert_eq!(server.cli(&["get", "k"]), "v");
    assert_eq!(server.cmd(&[b"GET", b"k"]), RespValue::Bulk(b"v".to_vec()));
    let pid = server.pid().expect("running");
    assert_eq!(redis_server_pid(&server), pid);

    server.kill();
    assert!(!server.ping());
    assert!(server.pid().is_none());
    assert!(resp_command(server.addr(), None, &[b"PING"]).is_err());

    server.restart();
    assert_eq!(server.port(), port);
    assert!(server.ping());
    assert_ne!(server.pid(), Some(pid));
    // No persistence: the restarted server is empty.
    assert_eq!(server.cmd(&[b"EXISTS", b"k"]), RespValue::Integer(0));

    server.pause();
    let started = Instant::now();
    let paused = resp_command_timeout(server.addr(), None, &[b"PING"], Duration::from_millis(500));
    assert!(paused.is_err(), "a paused server answered {paused:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    assert!(!server.ping());

    server.resume();
    assert!(server.ping());
    // Killing a paused server works too (also what drop does).
    server.pause();
    server.kill();
    server.restart();
    assert!(server.ping());
}

#[test]
fn requirepass_is_enforced() {
    let server = RedisServer::builder().requirepass("s3cret p@ss").start();
    assert_eq!(server.password(), Some("s3cret p@ss"));
    assert_eq!(
        server.auth_url(),
        format!("redis://:s3cret%20p%40ss@127.0.0.1:{}", server.port())
    );
    match resp_command(server.addr(), None, &[b"PING"]) {
        Ok(RespValue::Error(e)) => assert!(e.starts_with("NOAUTH"), "{e}"),
        other => panic!("PING without a password: {other:?}"),
    }
    let wrong = resp_command(server.addr(), Some("wrong"), &[b"PING"]);
    assert!(wrong.as_ref().is_err_and(|e| e.contains("AUTH")), "{wrong:?}");
    assert_eq!(resp_command(server.addr(), Some("s3cret p@ss"), &[b"PING"]), Ok(pong()));
    assert!(server.ping());
    assert_eq!(server.cli(&["ping"]), "PONG");
    // The URL with the password logs in.
    let target = RedisTarget::parse(&server.auth_url()).unwrap();
    assert_eq!(target.password.as_deref(), Some("s3cret p@ss"));
    assert_eq!(target.cmd(&[b"PING"]), pong());
    // And so do the checks.
    server.cmd(&[b"SET", b"t:k", b"v"]);
    assert_eq!(keys_without_ttl(&server, "t:"), ["t:k"]);
}

#[test]
fn maxmemory_refuses_writes_beyond_the_limit() {
    let server = RedisServer::builder().maxmemory(4 << 20).start();
    assert_eq!(
        server.cli(&["config", "get", "maxmemory"]),
        format!("maxmemory\n{}", 4 << 20)
    );
    assert_eq!(
        server.cli(&["config", "get", "maxmemory-policy"]),
        "maxmemory-policy\nnoeviction"
    );
    let value = vec![b'x'; 64 << 10];
    let refused = (0..200).find_map(|i| {
        let key = format!("big:{i}");
        match resp_command(server.addr(), None, &[b"SET", key.as_bytes(), &value]) {
            Ok(RespValue::Error(e)) => Some(e),
            Ok(_) => None,
            Err(e) => panic!("SET: {e}"),
        }
    });
    assert!(refused.as_deref().is_some_and(|e| e.starts_with("OOM")), "{refused:?}");
}

#[test]
fn scan_finds_keys_of_any_bytes_without_a_ttl() {
    let server = RedisServer::start();
    let prefix = unique_prefix("scan");
    let odd = format!("{prefix}a{{b}}:c:é");
    let expiring = format!("{prefix}{{b}}:expiring:é");
    let raw: Vec<u8> = [prefix.as_bytes(), b"raw\xff\x00\r\n{x}"].concat();
    server.cmd(&[b"SET", odd.as_bytes(), "v{}:é".as_bytes()]);
    server.cmd(&[b"SET", expiring.as_bytes(), b"v"]);
    assert_eq!(
        server.cmd(&[b"PEXPIRE", expiring.as_bytes(), b"60000"]),
        RespValue::Integer(1)
    );
    server.cmd(&[b"SET", &raw, b"v"]);
    server.cmd(&[b"SET", b"other:key", b"v"]);
    // A hash (not a string) without TTL is found as well.
    server.cmd(&[b"HSET", format!("{prefix}hash").as_bytes(), b"f", b"1"]);

    assert_eq!(
        server.keys_without_ttl(&prefix),
        [
            format!("{prefix}a{{b}}:c:é"),
            format!("{prefix}hash"),
            String::from_utf8_lossy(&raw).into_owned()
        ]
    );
    let raw_found = keys_without_ttl_raw(server.port(), prefix.as_bytes());
    assert!(raw_found.contains(&raw), "{raw_found:?}");
    assert_eq!(raw_found.len(), 3);
    assert_eq!(
        keys_without_ttl(server.url().as_str(), "nothing:"),
        Vec::<String>::new()
    );
}

#[test]
fn glob_characters_in_the_prefix_are_matched_literally() {
    let server = RedisServer::start();
    assert_eq!(scan_pattern(b"a*?[]\\b"), b"a\\*\\?\\[\\]\\\\b*".to_vec());
    let prefix = "t[1]*?\\:";
    server.cmd(&[b"SET", format!("{prefix}k").as_bytes(), b"v"]);
    // Would match the prefix taken as a glob, `t[1]*?\:*`.
    server.cmd(&[b"SET", b"t1zz::k", b"v"]);
    assert_eq!(keys_without_ttl(&server, prefix), [format!("{prefix}k")]);
}

#[test]
fn unique_prefixes_differ_and_have_no_hash_tags() {
    let a = unique_prefix("some{test}");
    let b = unique_prefix("some{test}");
    assert_ne!(a, b);
    for p in [&a, &b] {
        assert!(p.starts_with("tollgate-test:some_test_:"), "{p}");
        assert!(p.ends_with(':'), "{p}");
        assert!(!p.contains(['{', '}']), "{p}");
    }
    assert!(a.contains(&format!(":{}:", std::process::id())), "{a}");
}

#[test]
fn info_commandstats_and_pid() {
    let server = RedisServer::start();
    for _ in 0..3 {
        server.cmd(&[b"SET", b"k", b"v"]);
    }
    let stats = info_commandstats(&server);
    let (calls, usec) = stats["set"];
    assert_eq!(calls, 3);
    assert!(usec >= 0.0);
    assert_eq!(redis_server_pid(server.port()), server.pid().unwrap());

    let parsed = parse_commandstats(
        "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=345,usec_per_call=28.75,rejected_calls=0,failed_calls=1\r\n\
         cmdstat_client|setname:calls=2,usec=1,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n",
    );
    assert_eq!(parsed["evalsha"], (12, 345.0));
    assert_eq!(parsed["client|setname"], (2, 1.0));
    assert_eq!(parsed.len(), 2);
}

#[test]
fn the_shared_server_with_a_unique_prefix() {
    let Some(url) = shared_redis("the_shared_server_with_a_unique_prefix") else {
        return;
    };
    let target = RedisTarget::parse(&url).unwrap();
    let prefix = unique_prefix("shared");
    let forever = format!("{prefix}{{é}}:forever");
    let expiring = format!("{prefix}{{é}}:expiring");
    target.cmd(&[b"SET", forever.as_bytes(), b"v"]);
    target.cmd(&[b"SET", expiring.as_bytes(), b"v", b"PX", b"60000"]);
    let found = keys_without_ttl(url.as_str(), &prefix);
    // Clean up (only this test's keys) before asserting.
    target.cmd(&[b"DEL", forever.as_bytes(), expiring.as_bytes()]);
    assert_eq!(found, [forever]);
    assert!(info_commandstats(url.as_str()).contains_key("set"));
    assert!(redis_server_pid(url.as_str()) > 0);
}

#[test]
fn a_three_master_cluster() {
    let started = Instant::now();
    let cluster = RedisCluster::start();
    eprintln!("cluster up in {:?}", started.elapsed());
    assert_eq!(cluster.urls().len(), 3);
    assert_eq!(cluster.nodes().len(), 3);
    for node in 0..3 {
        let info = cluster.cli(node, &["cluster", "info"]);
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_ok:16384"), "{info}");
        assert!(info.contains("cluster_size:3"), "{info}");
    }
    let prefix = unique_prefix("cluster");
    // Enough keys that every master holds some; set through node 0, following redirections.
    for i in 0..30 {
        let key = format!("{prefix}k{i}:é");
        assert_eq!(cluster.cli(0, &["set", &key, "v"]), "OK");
    }
    let expiring = format!("{prefix}{{tag}}:expiring");
    assert_eq!(cluster.cli(1, &["set", &expiring, "v", "px", "60000"]), "OK");
    for node in 0..3 {
        let size = cluster.cmd(node, &[b"DBSIZE"]).as_int().unwrap();
        assert!(size > 0, "node {node} holds no key");
    }
    let mut expected: Vec<String> = (0..30).map(|i| format!("{prefix}k{i}:é")).collect();
    expected.sort();
    assert_eq!(cluster.keys_with_ttl_problems(&prefix), expected);
    assert_eq!(cluster.cli(2, &["get", &format!("{prefix}k7:é")]), "v");
}
