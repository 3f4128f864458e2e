-- Token bucket state, one row per bucket instance (DESIGN 2), in the schema named by the
-- `postgres.schema` setting (tollgate sets it as the search path).
--
-- key: the bucket instance key (domain, bucket name, runtime entries), as bytes.
-- tokens_ut, updated_us: the state (micro-tokens, microseconds since the epoch); NULL in a row
--   a request's first touch created and did not change, which reads as a full bucket.
-- full_at_us: when the bucket is full again (µs): from then on the row may be swept.
CREATE TABLE IF NOT EXISTS tollgate_buckets (
    key bytea PRIMARY KEY,
    tokens_ut bigint,
    updated_us bigint,
    full_at_us bigint NOT NULL DEFAULT 0
);

CREATE INDEX IF NOT EXISTS tollgate_buckets_full_at ON tollgate_buckets (full_at_us);
