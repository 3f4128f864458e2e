//! The ways a rule of envoyproxy/ratelimit's schema behaves differently in tollgate, as
//! `tollgate check --explain` tags and explains them.

/// One way a rule's behaviour in tollgate differs from envoyproxy/ratelimit's, or a point a
/// migration should know; `--explain` tags each rule with the ones that apply and explains each
/// tag used once, at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Difference {
    TokenBucket,
    WindowEdge,
    DeniedHits,
    EpochWindow,
    Zero,
    Unlimited,
    Shadow,
    QuotaMode,
    Replaces,
    ShareThreshold,
    Metrics,
    Wildcard,
}

impl Difference {
    pub(super) fn tag(self) -> &'static str {
        match self {
            Difference::TokenBucket => "[token-bucket]",
            Difference::WindowEdge => "[window-edge]",
            Difference::DeniedHits => "[denied-hits]",
            Difference::EpochWindow => "[epoch-window]",
            Difference::Zero => "[zero]",
            Difference::Unlimited => "[unlimited]",
            Difference::Shadow => "[shadow]",
            Difference::QuotaMode => "[quota-mode]",
            Difference::Replaces => "[replaces]",
            Difference::ShareThreshold => "[share-threshold]",
            Difference::Metrics => "[metrics]",
            Difference::Wildcard => "[wildcard]",
        }
    }

    pub(super) fn legend(self) -> &'static str {
        match self {
            Difference::TokenBucket => {
                "envoyproxy/ratelimit counts hits in fixed windows of one unit and forgets the count \
                 whole at each window's end; tollgate keeps a token bucket whose capacity is \
                 requests_per_unit and which refills continuously at requests_per_unit per unit. The \
                 burst is the same (requests_per_unit at once from full); after it, tokens come back one \
                 at a time instead of all at the next window edge. duration_until_reset is the time to \
                 the window's end there, the time until the bucket is full here; a denied request gets \
                 Retry-After with the exact wait for its tokens."
            }
            Difference::WindowEdge => {
                "No double burst at a window edge: a fixed window admits requests_per_unit in the last \
                 moment of one window and requests_per_unit again in the first moment of the next, so 2 x \
                 requests_per_unit within a short time. A token bucket admits at most its capacity plus \
                 what it refilled in that time."
            }
            Difference::DeniedHits => {
                "Denied hits consume nothing in tollgate, and a request is decided all or nothing: when one \
                 descriptor is over its limit, no bucket of the request is charged. envoyproxy/ratelimit \
                 adds every hit to the window's counter, admitted or not (unless its \
                 STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT is set), and charges the other descriptors of a \
                 denied request too; a request's hits_addend larger than what is left is denied there and \
                 still added, here denied and the remaining tokens stay for smaller requests. A \
                 descriptor's own hits_addend (a check with 0, a usage report) is counted here as there, \
                 in an account of its own."
            }
            Difference::EpochWindow => {
                "envoyproxy/ratelimit aligns windows to the Unix epoch in UTC: DAY starts at 00:00 UTC, \
                 WEEK on Thursdays 00:00 UTC (1970-01-01 was a Thursday), MONTH is a 30-day window counted \
                 from the epoch, not a calendar month, and YEAR 365 days counted from it, drifting a day \
                 per leap year. tollgate reads MONTH as 30 days and YEAR as 365 days of continuous refill. \
                 For an allowance that resets at calendar edges, use a tollgate quota, e.g. `quota: {limit: \
                 N, reset: \"0 0 1 * *\", timezone: UTC}` for calendar months."
            }
            Difference::Zero => {
                "requests_per_unit: 0 (or missing) denies every request in both. tollgate reports it as 0 \
                 per its unit and consumes nothing; envoyproxy/ratelimit still counts the hits."
            }
            Difference::Unlimited => {
                "unlimited: true is never limited in either and touches no counter or bucket. A \
                 `replaces` on an unlimited rule applies in both: it drops the named limits from the \
                 request, an exception carved out of a wider limit."
            }
            Difference::Shadow => {
                "shadow_mode: true never denies in either; the rule is still evaluated and its bucket \
                 charged while it has tokens, so its counters show what enforcement would do. Over the \
                 limit is counted as code=\"shadow_over_limit\" in tollgate_decisions_total and \
                 tollgate_hits_total (envoyproxy/ratelimit: its shadow_mode counter)."
            }
            Difference::QuotaMode => {
                "quota_mode: true (or the QUOTA_MODE / response.quota_mode switch for every rule): over its \
                 limit, the rule's descriptor is OVER_LIMIT in its status, but the request is denied only when \
                 every quota-mode descriptor of the request is over (or a rule without quota mode is), as in \
                 envoyproxy/ratelimit. A denied request takes nothing from any bucket, and an admitted one \
                 nothing from the bucket that is over; envoyproxy/ratelimit counts every hit either way."
            }
            Difference::Replaces => {
                "replaces: when this rule and a rule carrying the named `name` match descriptors of one \
                 request, the named one is not applied (its descriptor answers OK without a limit), as in \
                 envoyproxy/ratelimit. tollgate refuses at load what that project accepts silently: a \
                 name no rule of the file carries, and cycles."
            }
            Difference::ShareThreshold => {
                "share_threshold: true on a wildcard value: every value matching the pattern shares one \
                 bucket (in envoyproxy/ratelimit one counter), instead of one per value; the same in both."
            }
            Difference::Metrics => {
                "detailed_metric and value_to_metric change only envoyproxy/ratelimit's stats keys (they \
                 add the request's values to them). In tollgate they shape only the envoyproxy/ratelimit-named \
                 series (metrics.envoyproxy_names): detailed_metric keys them by the request's values, for at \
                 most 1000 keys per process; value_to_metric is not applied (the key alone). Its tollgate_* \
                 metrics are labelled by domain and bucket name, never by a request's values, so their number \
                 stays bounded."
            }
            Difference::Wildcard => {
                "A value with `*` matches like envoyproxy/ratelimit's wildcards (a prefix `foo*`, or `*` \
                 anywhere): at each level the exact value first, then the wildcards, then the key alone. \
                 Of several matching wildcards of a key, tollgate applies the one with the longest literal \
                 prefix (the text before the first `*`), and of equal prefixes the first in file order; \
                 envoyproxy/ratelimit applies the first in file order, so where a shorter prefix is listed \
                 first (`/api/*` before `/api/v1/*`) it never reaches the longer one, which tollgate applies \
                 to its values. envoyproxy/ratelimit matches the joined text `key_value` against `key_pattern`, \
                 so a key containing `_` can match another key's pattern there; tollgate compares the key \
                 exactly and the pattern with the value only. Without share_threshold each matching value \
                 has its own bucket in both."
            }
        }
    }
}
