-- Decides one rate-limit request over all its bucket instances in one atomic step: reads the
-- clock with TIME, brings every bucket forward to now, checks every demand, and consumes from
-- all of them or none (DESIGN 1.2). Tollgate's memory store runs the same arithmetic in Rust
-- (src/bucket); tests/vectors/token_bucket.yaml pins both to the same micro-token.
--
-- Units: microseconds since the epoch, micro-tokens (1 token = 1,000,000). Lua numbers are
-- doubles, so every intermediate stays below 2^53 by the bounds tollgate enforces when it loads
-- the rules (capacity <= 10^9 tokens, refill num * den < 2^53): see src/bucket/rate.rs.
--
-- KEYS: the request's bucket instances (one Cluster slot per call).
-- ARGV: now override in µs ("" = Redis TIME; tests only), #buckets, #demands, TTL margin (ms),
--   the longest TTL (ms); then per bucket 9 fields:
--     kind   F (a constant limit), S (a schedule), Q (a calendar quota)
--     cap, num, den   the limit in force: capacity (µt) and rate (num µt per den µs)
--     lo, hi  the limit holds over [lo, hi) (0 = unbounded); for Q, lo is the last reset edge
--             (0 = none) and hi the next; outside that interval the script asks again
--     bound   S: when a bucket emptied at hi would be full again (0 = unknown); Q: unused
--     expect  "" or the stored value tollgate brought forward with `rep`
--     rep     "" or "tokens:updated", the stored value `expect` brought forward by tollgate to
--             the last change of limit (a schedule walk Lua does not do)
--   then per demand 4 fields: instance (1-based), kind (c consume, k check, r refund), amount
--   (µt), enforced (1 or 0).
-- A stored value is "tokens:updated:end": end is when the limit it was written under stops
-- holding (0 = never), so that a later call knows whether a change of limit lies between.
--
-- Returns {"ok", now, denied, passed ("1"/"0" per demand), then per bucket: stored tokens,
-- stored updated, tokens before, updated before, tokens after, updated after, changed};
-- {"retry", now, t1, ..., tn} when some bucket's time t (now, or a later write) lies outside
-- its [lo, hi); or {"walk", now, i, value, ...}
-- for scheduled buckets crossed by a change of limit since they were written.

local MICRO = 1000000

-- floor(a / b) for integers 0 <= a, 0 < b below 2^53, exact although a / b is rounded.
local function fdiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

-- Micro-tokens earned over `elapsed`, or nil once they reach `missing` (Rate::credit).
local function credit(elapsed, missing, num, den)
  if num == 0 then return 0 end
  local whole = fdiv(elapsed, den)
  if whole > fdiv(missing, num) then return nil end
  local c = whole * num + fdiv((elapsed - whole * den) * num, den)
  if c < missing then return c end
  return nil
end

-- The shortest time after which `credit` reaches `deficit` (Rate::time_to_earn); nil: never.
local function time_to_earn(deficit, num, den)
  if deficit <= 0 then return 0 end
  if num == 0 then return nil end
  local q = fdiv(deficit, num)
  local r = deficit - q * num
  local c = fdiv(r * den, num)
  if c * num < r * den then c = c + 1 end
  return q * den + c
end

-- bucket::refill: trim to the capacity, then earn for the time elapsed; never move back.
local function refill(t, u, cap, num, den, now)
  if t > cap then t = cap end
  local elapsed = now - u
  if elapsed < 0 then elapsed = 0 end
  local c = credit(elapsed, cap - t, num, den)
  if c then t = t + c else t = cap end
  if now > u then u = now end
  return t, u
end

local function fmt(x) return string.format('%.0f', x) end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * MICRO + tonumber(time[2])
end
local nb, nd = tonumber(ARGV[2]), tonumber(ARGV[3])
local margin_ms, max_ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5])

local b = {}
for i = 1, nb do
  local o = 5 + (i - 1) * 9
  local x = {kind = ARGV[o + 1], cap = tonumber(ARGV[o + 2]), num = tonumber(ARGV[o + 3]),
    den = tonumber(ARGV[o + 4]), lo = tonumber(ARGV[o + 5]), hi = tonumber(ARGV[o + 6]),
    bound = tonumber(ARGV[o + 7]), expect = ARGV[o + 8], rep = ARGV[o + 9]}
  b[i] = x
end

-- Read every bucket: absent means full at the capacity in force.
local walk = {'walk', now}
for i = 1, nb do
  local x = b[i]
  local raw = redis.call('GET', KEYS[i])
  if raw and x.expect ~= '' and raw == x.expect then
    local t, u = string.match(x.rep, '^(%d+):(%d+)$')
    if not t then return redis.error_reply('tollgate: bad replacement ' .. x.rep) end
    x.st, x.su = tonumber(t), tonumber(u)
  elseif raw then
    local t, u, e = string.match(raw, '^(%d+):(%d+):(%d+)$')
    if not t then return redis.error_reply('tollgate: bad bucket value in ' .. KEYS[i]) end
    x.st, x.su, e = tonumber(t), tonumber(u), tonumber(e)
    if x.kind == 'S' and e > 0 and now >= e then
      walk[#walk + 1] = i
      walk[#walk + 1] = raw
    end
  else
    x.st, x.su = x.cap, now
  end
end
if #walk > 2 then return walk end

-- The limit each bucket is decided under is the one at its own time: now, or for a scheduled
-- bucket written later than now (Redis's clock stepped back), its write, as the memory store
-- does. Outside [lo, hi) tollgate must look the limit up again for that time.
local retry = {'retry', now}
local stale = false
for i = 1, nb do
  local x = b[i]
  local at = now
  if x.kind == 'S' and x.su > now then at = x.su end
  retry[i + 2] = at
  if x.kind ~= 'F' and (at < x.lo or (x.hi > 0 and at >= x.hi)) then stale = true end
end
if stale then return retry end

-- Bring each forward to now (before), then add up the demands per bucket.
for i = 1, nb do
  local x = b[i]
  if x.kind == 'Q' then
    if now > x.su and x.lo > x.su then
      x.bt, x.bu = x.cap, now
    else
      x.bt, x.bu = math.min(x.st, x.cap), math.max(x.su, now)
    end
  else
    x.bt, x.bu = refill(x.st, x.su, x.cap, x.num, x.den, now)
  end
  x.consumed, x.refunded = 0, 0
end
local d = {}
for j = 1, nd do
  local o = 5 + nb * 9 + (j - 1) * 4
  local dm = {i = tonumber(ARGV[o + 1]), kind = ARGV[o + 2], n = tonumber(ARGV[o + 3]),
    enforced = ARGV[o + 4] == '1'}
  local x = b[dm.i]
  if dm.kind == 'c' then x.consumed = x.consumed + dm.n
  elseif dm.kind == 'r' then x.refunded = x.refunded + dm.n end
  d[j] = dm
end

local denied = false
local passed = {}
for j = 1, nd do
  local dm = d[j]
  local x = b[dm.i]
  local ok = true
  if dm.kind == 'c' then ok = x.bt >= x.consumed
  elseif dm.kind == 'k' then ok = x.bt >= x.consumed + MICRO end
  passed[j] = ok and '1' or '0'
  if dm.enforced and not ok then denied = true end
end

local out = {'ok', now, denied and 1 or 0, table.concat(passed)}
for i = 1, nb do
  local x = b[i]
  local t = x.bt
  local take = (not denied) and x.consumed > 0 and t >= x.consumed
  if take then t = t - x.consumed end
  local give = x.refunded > 0 and t < x.cap
  if give then t = math.min(t + x.refunded, x.cap) end
  if take or give then
    if t >= x.cap then
      -- A full bucket is the same as no bucket.
      redis.call('DEL', KEYS[i])
    else
      local full_at
      local w = time_to_earn(x.cap - t, x.num, x.den)
      if x.kind == 'F' then
        if w then full_at = x.bu + w end
      elseif x.kind == 'S' then
        if w and x.bu + w < x.hi then full_at = x.bu + w
        elseif x.bound > 0 then full_at = x.bound end
      elseif x.hi > 0 then
        full_at = x.hi
      end
      local ttl = max_ttl_ms
      if full_at then
        ttl = math.min(max_ttl_ms, math.ceil((full_at - now) / 1000) + margin_ms)
      end
      if ttl < 1 then ttl = 1 end
      local e = 0
      if x.kind == 'S' then e = x.hi end
      redis.call('SET', KEYS[i], fmt(t) .. ':' .. fmt(x.bu) .. ':' .. fmt(e), 'PX', fmt(ttl))
    end
  end
  local n = #out
  out[n + 1], out[n + 2], out[n + 3], out[n + 4] = x.st, x.su, x.bt, x.bu
  out[n + 5], out[n + 6], out[n + 7] = t, x.bu, (take or give) and 1 or 0
end
return out
