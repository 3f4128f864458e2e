-- Fills buckets again by forgetting them (an absent bucket is full): returns now in
-- microseconds by Redis TIME (ARGV[1] overrides it in tests).
for i = 1, #KEYS do
  redis.call('DEL', KEYS[i])
end
if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
local time = redis.call('TIME')
return tonumber(time[1]) * 1000000 + tonumber(time[2])
