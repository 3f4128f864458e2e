# syntax=docker/dockerfile:1
# The tollgate image: `docker build -t tollgate .`, then `docker run -p 8081:8081 -p 8080:8080 tollgate`.
# docs/deployment.md describes the layout; tests/suite/image.rs runs the release binary from a copy of
# exactly what the runtime stage below copies, as its user and with its environment.

# The toolchain the project builds with (rust-version in Cargo.toml is the minimum).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The registry and target directories are cache mounts (kept between builds, not in a layer), so
# the binary is copied out of target/ in the same step. /out is laid out as the runtime's root:
# the binary, and /bin/ratelimit as a second name for it (a symlink, so the image holds the
# binary once), for manifests written for envoyproxy/ratelimit's image, which runs that path.
# The release profile keeps line tables for backtraces (~94 MB); the image drops them (symbols
# stay, so a panic's backtrace still names functions).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    CARGO_PROFILE_RELEASE_STRIP=debuginfo cargo build --release --locked --bin tollgate \
    && install -D -m 0755 target/release/tollgate /out/usr/local/bin/tollgate \
    && mkdir -p /out/bin \
    && ln -s /usr/local/bin/tollgate /out/bin/ratelimit

# glibc, libgcc and CA certificates (TLS to Redis and Postgres reads the system's roots); no
# shell, no package manager. The health check below uses `tollgate probe`, since there is no curl.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/usr/local/bin/tollgate /usr/local/bin/tollgate
# A directory copy keeps the symlink a symlink.
COPY --from=build /out/bin/ /bin/
WORKDIR /srv/tollgate
# The example settings and rules: `serve` reads config/tollgate.yaml, whose `rules` is
# config/rules, from the working directory. Mount a ConfigMap over config/rules to replace them.
COPY config/ /srv/tollgate/config/
# Logs as JSON lines for log collectors.
ENV TOLLGATE_LOG__FORMAT=json
# nobody:nogroup. The files above stay root's and read-only to it: tollgate writes nothing, so
# the root filesystem may be mounted read-only.
USER 65534:65534
# 8081: Envoy's RateLimitService (gRPC) and grpc.health.v1; 8080: /healthz /readyz /metrics.
# The admin API and /config (8082) listen on loopback inside the container only.
EXPOSE 8081 8080
# Liveness, not readiness: an orchestrator that restarts unhealthy containers (Swarm, ECS,
# Nomad) would otherwise restart every replica during a backend outage, which a restart cannot
# fix. Readiness (/readyz) is for load balancers and compose's depends_on.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/tollgate", "probe", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["/usr/local/bin/tollgate", "serve"]
