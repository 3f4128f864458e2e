-- Reads buckets without changing them, as of one instant: returns {now, value or "", ...}
-- with now in microseconds by Redis TIME (ARGV[1] overrides it in tests). Tollgate brings the
-- values forward itself (the same arithmetic as lua/decide.lua).
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local out = {now}
for i = 1, #KEYS do
  out[i + 1] = redis.call('GET', KEYS[i]) or ''
end
return out
