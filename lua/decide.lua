-- Decides a batch of rate-limit requests, each over all its bucket instances in one atomic
-- step: reads the clock with TIME once, then for each request in order brings every bucket
-- forward to now, checks every demand, and consumes from all of them or none (docs/rules.md).
-- Requests of one batch are decided one after the other, so a later request sees what an
-- earlier one consumed, exactly as if each had its own call. Tollgate's memory store runs the
-- same arithmetic in Rust (src/bucket); tests/vectors/token_bucket.yaml pins both to the same
-- micro-token.
--
-- Units: microseconds since the epoch, micro-tokens (1 token = 1,000,000). Lua numbers are
-- doubles, so every intermediate stays below 2^53 by the bounds tollgate enforces when it loads
-- the rules (capacity, a debt bucket's floor included, <= 9 * 10^9 tokens, refill num * den <
-- 2^53): see src/core/bucket/rate.rs.
--
-- KEYS: each request's bucket instances, request after request (one Cluster slot per call).
-- ARGV: now override in µs ("" = Redis TIME; tests only), TTL margin (ms), the TTL (ms) of a
--   bucket whose full time is unknown (0: no expiry), #requests; then per request one string of little-endian doubles (struct.pack '<d';
--   every value is an integer below 2^53, so exact), read here with no text parsing:
--     #buckets, #demands, #replacements;
--     per bucket 9: kind (1 F a constant limit, 2 S a schedule, 3 Q a calendar quota, 4 D a
--       debt quota: a quota whose reset adds an allowance, counted by tollgate, so a value
--       written before the last edge is walked, 5 E an expiring allowance: no refill, whole
--       again `bound` µs after its period's first use, which its stored `updated` keeps);
--       cap, num, den: the limit in force, capacity (µt) and rate (num µt per den µs);
--       lo, hi: the limit holds over [lo, hi) (0 = unbounded); for Q, lo is the last reset
--       edge (0 = none) and hi the next; outside that interval the script asks again;
--       bound: S, when a bucket emptied at hi would be full again (0 = unknown); D, the edge
--       after hi, when any balance is full again; E, the length of a period; else unused;
--       replaced: 1 if a replacement follows for this bucket;
--       since: when a reload replaced the limit (0 = none remembered): a value written
--       before it is sent back to tollgate ("walk"), which brings it forward under the old
--       rules up to the reload; an F limit given with lo or hi holds only over [lo, hi);
--     per demand 5: instance (1-based within the request), kind (1 consume, 2 check,
--       3 refund, 4 debit: a usage report on a debt bucket, taken whatever the decision down to
--       an empty bucket, 5 debt check), amount (µt), enforced (1 or 0), need (4 and 5: passes
--       iff the bucket holds that many µt, one more than its floor's depth; else 0);
--   then per replaced bucket, in bucket order, two strings: the stored value tollgate read
--   (expect) and two doubles tokens, updated: that value brought forward by tollgate to the
--   last change of limit (a schedule walk Lua does not do); used only if the key still holds
--   expect.
-- A stored value is 24 bytes, three little-endian doubles (integers): tokens (µt), updated
-- (µs) and end (µs: when the limit it was written under stops holding, 0 = never, so that a
-- later call knows whether a change of limit lies between). Binary, because formatting and
-- parsing decimal text was a tenth of Redis's CPU per request; `tollgate bucket peek` shows a
-- bucket. The text form "tokens:updated:end" of earlier versions is still read, and replaced
-- by the binary one at the bucket's next write.
--
-- Expiry: a written key must expire between due = now + (time until full) + margin and
-- due + margin (Redis's clock, ms), however far away that is (a 10-year fill, a quota reset on
-- 29 February): expiring earlier would forget a drained bucket. A bucket whose full time is
-- unknown (a schedule whose refill tollgate's look-ahead does not reach) keeps no expiry
-- until a write finds it, as the memory and Postgres stores keep theirs. A key whose expiry (PEXPIRETIME, so whatever set it)
-- already lies in that range keeps it (SET ... KEEPTTL); any other, including none, is set to
-- due + margin with PXAT. Setting an expiry costs Redis a third of a SET, reading one far less,
-- and a busy bucket's range moves slowly, so most writes keep it. Needs Redis 6.2 (PXAT,
-- KEEPTTL); before 7.0 (no PEXPIRETIME) every write sets the expiry.
--
-- A request whose packed string starts with a negative count is a lean one (`decide_lean`
-- below: plain token buckets, consuming demands).
--
-- Returns one answer per request, in order, then the call's time (µs) as a last element:
--   a decision, as one string (not a table: Redis turns a table into a reply at several
--    times the cost) of little-endian doubles: now, denied (1/0), passed (1/0) per
--    demand, then per bucket 8: stored tokens, stored updated, tokens before, updated
--    before, tokens after, updated after, changed (1/0), lost (µt of debits that found the
--    bucket empty);
--   {"retry", now, t1, ..., tn} when some bucket's time t (now, or a later write) lies outside
--    its [lo, hi); nothing was changed;
--   {"walk", now, i, value, ...} for scheduled buckets crossed by a change of limit since they
--    were written, and buckets written before a reload that changed their limit; nothing was
--    changed;
--   {"bad", now, reason} for a stored value the script cannot read (or a key of another type);
--    nothing was changed.
-- A bad answer for one request leaves the others of the batch decided.

local MICRO = 1000000

-- Globals are table lookups in Lua; the script runs these per bucket, so keep locals.
local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max
local tonum, match, format = tonumber, string.match, string.format
local call, pcall_ = redis.call, redis.pcall
local pack, unpack_fields, rep = struct.pack, struct.unpack, string.rep

-- 2^53: stored numbers past it (or not integers) are not tollgate's.
local EXACT = 9007199254740992

-- Lua 5.1 holds a function's results on a C stack of about 8000 slots, so numbers are unpacked
-- and packed at most CHUNK at a time: a request of any size reads and answers, never overflows.
local CHUNK = 256

-- struct formats of n doubles, built once per n.
local formats = {}
local function doubles(n)
  local f = formats[n]
  if not f then
    f = '<' .. rep('d', n)
    formats[n] = f
  end
  return f
end

-- floor(a / b) for integers 0 <= a, 0 < b below 2^53, exact although a / b is rounded.
local function fdiv(a, b)
  local q = floor(a / b)
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

-- The n doubles of `s` from byte `pos` on, as a list.
local function read_numbers(s, pos, n)
  if n <= CHUNK then return {unpack_fields(doubles(n), s, pos)} end
  local f = {}
  for i = 0, n - 1, CHUNK do
    local k = min(CHUNK, n - i)
    local chunk = {unpack_fields(doubles(k), s, pos)}
    for j = 1, k do f[i + j] = chunk[j] end
    pos = chunk[k + 1]
  end
  return f
end

-- The first n numbers of list `out`, packed.
local function pack_numbers(out, n)
  if n <= CHUNK then return pack(doubles(n), unpack(out, 1, n)) end
  local parts = {}
  for i = 1, n, CHUNK do
    local k = min(CHUNK, n - i + 1)
    parts[#parts + 1] = pack(doubles(k), unpack(out, i, i + k - 1))
  end
  return table.concat(parts)
end

-- Whether a stored number is one tollgate wrote: an integer from 0 to 2^53 (NaN is not).
local function valid(v)
  return v >= 0 and v <= EXACT and floor(v) == v
end

-- Kept from request to request of a call: the buckets' tables and the answer's numbers.
local buckets, answer = {}, {}
-- Redis's own clock in ms (TIME), for expiry, even when tests override `now`.
local clock_ms
-- Whether the server has PEXPIRETIME (Redis 7.0); without it every write sets the expiry.
-- Asked once per call, and only when a general request writes (a lean one never reads it).
local has_pexpiretime
local function pexpiretime_known()
  if has_pexpiretime == nil then
    has_pexpiretime = type(pcall_('PEXPIRETIME', KEYS[1])) == 'number'
  end
  return has_pexpiretime
end

-- Decides one request whose keys start after KEYS[ko] and whose fields start after ARGV[ao];
-- returns its answer and where the next request's fields start.
local function decide(now, margin_ms, unknown_ttl_ms, ko, ao)
  local packed = ARGV[ao + 1]
  local nb, nd, nrep, pos = unpack_fields('<ddd', packed)
  local f = read_numbers(packed, pos, nb * 9 + nd * 5)
  local next_ao = ao + 1 + nrep * 2

  -- Read every bucket: absent means full at the capacity in force. The bucket tables are
  -- kept from request to request of the call (every field is set here), so a request
  -- allocates none.
  local b = buckets
  local walk
  local reps = ao + 1
  for i = 1, nb do
    local o = (i - 1) * 9
    local key, kind, cap = KEYS[ko + i], f[o + 1], f[o + 2]
    local expect, replaced
    if f[o + 8] == 1 then
      expect, replaced = ARGV[reps + 1], ARGV[reps + 2]
      reps = reps + 2
    end
    local raw = pcall_('GET', key)
    local st, su, stored = cap, now, false
    if type(raw) == 'table' then
      return {'bad', now, 'tollgate: bad bucket key ' .. key .. ': ' .. tostring(raw.err)}, next_ao
    elseif raw then
      stored = true
      -- Binary, else the text form of earlier versions. A text value can be 24 bytes long
      -- too, but its bytes (digits and colons) read as doubles are tiny fractions, never
      -- valid, so it falls through to the text pattern.
      local e
      if #raw == 24 then st, su, e = unpack_fields('<ddd', raw) end
      if not (e and valid(st) and valid(su) and valid(e)) then
        local t, u, x = match(raw, '^(%d+):(%d+):(%d+)$')
        if t then st, su, e = tonum(t), tonum(u), tonum(x) end
        if not (t and valid(st) and valid(su) and valid(e)) then
          return {'bad', now, 'tollgate: bad bucket value in ' .. key}, next_ao
        end
      end
      if expect and raw == expect then
        if #replaced ~= 16 then return {'bad', now, 'tollgate: bad replacement'}, next_ao end
        st, su = unpack_fields('<dd', replaced)
        if not (valid(st) and valid(su)) then return {'bad', now, 'tollgate: bad replacement'}, next_ao end
      elseif (kind == 2 and (e == 0 or now >= e)) or (f[o + 9] > 0 and su < f[o + 9])
          or (kind == 4 and now > su and f[o + 5] > su) then
        -- (A scheduled value always records its end: one without was written under another
        -- kind of limit, by a request on the rules before a reload, so it is walked too.)
        walk = walk or {'walk', now}
        walk[#walk + 1] = i
        walk[#walk + 1] = raw
      end
    end
    local x = b[i]
    if not x then
      x = {}
      b[i] = x
    end
    x.key, x.kind, x.cap, x.num, x.den, x.lo, x.hi = key, kind, cap, f[o + 3], f[o + 4], f[o + 5], f[o + 6]
    x.bound, x.st, x.su, x.stored, x.bt, x.bu, x.consumed, x.refunded = f[o + 7], st, su, stored, 0, 0, 0, 0
    x.debit = 0
  end
  if walk then return walk, next_ao end

  -- The limit each bucket is decided under is the one at its own time: now, or for a
  -- bucket written later than now (Redis's clock stepped back), its write, as the memory
  -- store does. Outside [lo, hi) tollgate must look the limit up again for that time. A
  -- constant limit (F) holds at every time, unless a reload bounds it (lo or hi).
  local stale = false
  for i = 1, nb do
    local x = b[i]
    if x.kind ~= 1 or x.lo > 0 or x.hi > 0 then
      local at = now
      if x.su > now then at = x.su end
      if at < x.lo or (x.hi > 0 and at >= x.hi) then stale = true end
    end
  end
  if stale then
    local retry = {'retry', now}
    for i = 1, nb do
      local x = b[i]
      retry[i + 2] = (x.su > now) and x.su or now
    end
    return retry, next_ao
  end

  -- Bring each forward to now (before), then add up the demands per bucket.
  for i = 1, nb do
    local x = b[i]
    if x.kind == 5 then
      -- An expiring allowance: whole with no period yet (the next use starts one) once its
      -- period has ended or when whole anyway; otherwise trimmed, its period's start kept (a
      -- clock stepping back ends nothing and never moves it back).
      if now >= x.su + x.bound or x.st >= x.cap then
        x.bt, x.bu = x.cap, max(now, x.su)
      else
        x.bt, x.bu = min(x.st, x.cap), x.su
      end
    elseif x.kind >= 3 then
      -- (A debt quota written before its last edge was walked above.)
      if now > x.su and x.lo > x.su then
        x.bt, x.bu = x.cap, now
      else
        x.bt, x.bu = min(x.st, x.cap), max(x.su, now)
      end
    else
      x.bt, x.bu = refill(x.st, x.su, x.cap, x.num, x.den, now)
    end
  end
  local dofs = nb * 9
  for j = 1, nd do
    local o = dofs + (j - 1) * 5
    local x, kind = b[f[o + 1]], f[o + 2]
    if kind == 1 then x.consumed = x.consumed + f[o + 3]
    elseif kind == 3 then x.refunded = x.refunded + f[o + 3]
    elseif kind == 4 then x.debit = x.debit + f[o + 3] end
  end

  local denied = false
  local out = answer
  out[1], out[2] = now, 0
  for j = 1, nd do
    local o = dofs + (j - 1) * 5
    local x, kind = b[f[o + 1]], f[o + 2]
    local ok = true
    if kind == 1 then ok = x.bt >= x.consumed
    elseif kind == 2 then ok = x.bt >= x.consumed + MICRO
    elseif kind >= 4 then ok = x.bt >= f[o + 5] end
    out[j + 2] = ok and 1 or 0
    if not ok and f[o + 4] == 1 then denied = true end
  end
  if denied then out[2] = 1 end

  local n = nd + 2
  for i = 1, nb do
    local x = b[i]
    local t = x.bt
    local take = (not denied) and x.consumed > 0 and t >= x.consumed
    if take then t = t - x.consumed end
    -- Usage that happened is recorded whatever the decision, down to the floor.
    local debited = min(x.debit, t)
    t = t - debited
    local give = x.refunded > 0 and t < x.cap
    if give then t = min(t + x.refunded, x.cap) end
    local changed = take or give or debited > 0
    if changed then
      if t >= x.cap then
        -- A full bucket is the same as no bucket.
        call('DEL', x.key)
      else
        local full_at
        local w = time_to_earn(x.cap - t, x.num, x.den)
        if x.kind == 1 then
          if w then full_at = x.bu + w end
        elseif x.kind == 2 then
          if w and x.bu + w < x.hi then full_at = x.bu + w
          elseif x.bound > 0 then full_at = x.bound end
        elseif x.kind == 4 and x.bound > 0 then
          full_at = x.bound
        elseif x.kind == 5 then
          full_at = x.bu + x.bound
        elseif x.hi > 0 then
          full_at = x.hi
        end
        local e = 0
        if x.kind == 2 then e = x.hi end
        local value = pack('<ddd', t, x.bu, e)
        if not full_at and unknown_ttl_ms == 0 then
          -- Plain SET drops any expiry: kept until a write finds the bucket full.
          call('SET', x.key, value)
        else
          local ttl = unknown_ttl_ms
          if full_at then ttl = ceil((full_at - now) / 1000) + margin_ms end
          if ttl < 1 then ttl = 1 end
          local due = clock_ms + ttl
          local expires = -1
          if x.stored and pexpiretime_known() then expires = call('PEXPIRETIME', x.key) end
          if expires >= due and expires <= due + margin_ms then
            call('SET', x.key, value, 'KEEPTTL')
          else
            call('SET', x.key, value, 'PXAT', format('%d', due + margin_ms))
          end
        end
      end
    end
    out[n + 1], out[n + 2], out[n + 3], out[n + 4] = x.st, x.su, x.bt, x.bu
    out[n + 5], out[n + 6], out[n + 7], out[n + 8] = t, x.bu, changed and 1 or 0, x.debit - debited
    n = n + 8
  end
  return pack_numbers(out, n), next_ao
end

-- A lean request's working lists, kept from request to request as `buckets` is.
local lean_t, lean_u, lean_c, lean_raw = {}, {}, {}, {}
-- A bucket with no key, in a lean answer: 24 bytes that never read as a valid value.
local ABSENT = rep('\255', 24)

-- A lean request: plain token buckets (a constant limit that refills, no reload to walk) and
-- consuming demands only, the shape of nearly every request. Its one ARGV field is a packed
-- string: -#buckets, #demands; per bucket cap, num, den; per demand instance, amount (µt),
-- enforced. It decides as `decide` does for such a request, and its keys expire as there
-- (one to two margins after full; always set, as PEXPIRETIME would cost about what it saves),
-- but it answers only what tollgate cannot work out itself: each bucket's stored value (24
-- bytes, or ABSENT: full at now), concatenated. From these tollgate computes the same decision
-- with the same arithmetic (src/core/bucket), at the call's time (the script's last element).
-- A value it cannot read (the text form of earlier versions, a key of another type) answers
-- "general" and changes nothing: tollgate sends the request again in the general form, which
-- reads or refuses it.
local function decide_lean(now, margin_ms, ko, ao, nb)
  local packed = ARGV[ao + 1]
  local _, nd, pos = unpack_fields('<dd', packed)
  local f = read_numbers(packed, pos, nb * 3 + nd * 3)
  local tt, tu, tc, raws = lean_t, lean_u, lean_c, lean_raw
  for i = 1, nb do
    local key = KEYS[ko + i]
    local raw = pcall_('GET', key)
    if type(raw) == 'table' then return 'general' end
    local o = (i - 1) * 3
    local cap = f[o + 1]
    local st, su = cap, now
    if raw then
      if #raw ~= 24 then return 'general' end
      local e
      st, su, e = unpack_fields('<ddd', raw)
      if not (valid(st) and valid(su) and valid(e)) then return 'general' end
      raws[i] = raw
    else
      raws[i] = ABSENT
    end
    tt[i], tu[i] = refill(st, su, cap, f[o + 2], f[o + 3], now)
    tc[i] = 0
  end
  local answer_ = raws[1]
  if nb > 1 then answer_ = table.concat(raws, '', 1, nb) end
  local dofs = nb * 3
  for j = 1, nd do
    local o = dofs + (j - 1) * 3
    local i = f[o + 1]
    tc[i] = tc[i] + f[o + 2]
  end
  for j = 1, nd do
    local o = dofs + (j - 1) * 3
    local i = f[o + 1]
    if f[o + 3] == 1 and tt[i] < tc[i] then return answer_ end
  end
  for i = 1, nb do
    local c = tc[i]
    if c > 0 and tt[i] >= c then
      local o = (i - 1) * 3
      local t = tt[i] - c
      local ttl = ceil((tu[i] + time_to_earn(f[o + 1] - t, f[o + 2], f[o + 3]) - now) / 1000) + margin_ms
      if ttl < 1 then ttl = 1 end
      call('SET', KEYS[ko + i], pack('<ddd', t, tu[i], 0), 'PX', format('%d', ttl + margin_ms))
    end
  end
  return answer_
end

local time = call('TIME')
local now = tonum(time[1]) * MICRO + tonum(time[2])
clock_ms = floor(now / 1000)
if ARGV[1] ~= '' then now = tonum(ARGV[1]) end
local margin_ms, unknown_ttl_ms, nreq = tonum(ARGV[2]), tonum(ARGV[3]), tonum(ARGV[4])

local answers = {}
local ko, ao = 0, 4
for r = 1, nreq do
  local nb = unpack_fields('<d', ARGV[ao + 1])
  if nb < 0 then
    nb = -nb
    answers[r] = decide_lean(now, margin_ms, ko, ao, nb)
    ao = ao + 1
  else
    answers[r], ao = decide(now, margin_ms, unknown_ttl_ms, ko, ao)
  end
  ko = ko + nb
end
-- The call's time last: a lean answer does not carry it.
answers[nreq + 1] = now
return answers
