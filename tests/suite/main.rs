//! The integration tests, as one test binary (one link, one `cargo test --test suite`): a
//! module per area, named as the files were before, and the helpers they share.
//!
//! `harness` runs the limiter in process on a manual clock; `support` runs `tollgate` and Envoy
//! as child processes and talks to Redis and Postgres on 127.0.0.1. Run one area with a filter:
//! `cargo test --test suite -- redis_faults::`.

mod harness;
mod support;

mod admin;
mod check_cli;
mod cold_start;
mod console;
mod deploy;
mod docs_examples;
mod envoy_e2e;
mod envoyproxy_compat;
mod envoyproxy_configs;
mod envoyproxy_env;
mod envoyproxy_names;
mod envoyproxy_statsd;
mod explain;
mod faults_under_load;
mod fixed_allowances;
mod grpc;
mod grpc_limits;
mod image;
mod instruction_gate;
mod limiter;
mod loadgen_smoke;
mod local_decisions;
mod metrics;
mod monitoring;
mod network_faults;
mod postgres_backend;
mod postgres_faults;
mod redis_backend;
mod redis_cluster_faults;
mod redis_connect;
mod redis_faults;
mod redis_sentinel;
mod redis_support;
mod reload;
mod resource_faults;
mod rlqs_envoy;
mod rlqs_grpc;
mod rlqs_hub;
mod rlqs_model;
mod rlqs_simulation;
mod schedules;
mod several_limits;
mod shadow_upstream;
mod shutdown;
mod simulation;
mod soak;
mod store_bounds;
mod tidy;
mod tls_listeners;
mod traces;
mod traces_export;
mod unix_socket;
mod usage_budgets;
mod usage_budgets_envoy;
mod vectors;
mod xds_break;
mod xds_envoy;
mod xds_rules;
