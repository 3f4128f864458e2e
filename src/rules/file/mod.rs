//! Rules configuration: the YAML model, validation, and compilation into a [`RuleSet`].
//!
//! Two schemas load side by side, node by node: tollgate's own (`buckets:` with named
//! token buckets, `bucket:` / `token_bucket:` on descriptors) and envoyproxy/ratelimit's
//! (`rate_limit: {unit, requests_per_unit, ...}`), which loads unchanged.
//!
//! [`RuleSet`]: crate::rules::RuleSet

mod compile;
mod error;
mod load;
mod metadata;
mod model;
mod refill;

pub(crate) use compile::node_path;
pub use error::ConfigError;
pub(crate) use error::ConfigErrors;
pub(crate) use load::compile_models;
pub(crate) use load::parse_file;
pub(crate) use load::rule_files;
pub use load::{load_rules, load_rules_merging, load_rules_text};
pub(crate) use model::{DescriptorSpec, RateLimitSpec, ReplaceSpec, RulesFile};
pub use refill::{parse_refill, Refill};
