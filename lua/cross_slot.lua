-- The Cluster form of lua/decide.lua (tollgate sends this file, then that one, after the line
-- `#!lua flags=allow-cross-slot-keys`, which needs Redis 7.0): one call decides the lean
-- requests of many slots that one master holds. Redis Cluster refuses a call whose declared
-- keys lie in different slots, so only the first is declared, for routing; all the keys come
-- at the end of ARGV, followed by their count, and stand in for KEYS below. A key that this
-- master does not hold (a slot that moved) fails its GET, and that request answers "general":
-- tollgate sends it again on its own slot's route.
local KEYS = (function()
  local n = tonumber(ARGV[#ARGV])
  local base = #ARGV - 1 - n
  local k = {}
  for i = 1, n do k[i] = ARGV[base + i] end
  return k
end)()
