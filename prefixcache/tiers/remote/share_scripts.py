"""The Lua scripts that keep the remote tier's tenant figures on the server.

Keys (one hash tag, so one shard of a cluster holds them all and a script may
touch them together)::

    <prefix>:{shares}:owner       hash   block name -> "<bytes>:<tenant>"
    <prefix>:{shares}:size        zset   tenant -> bytes held (tenants holding any)
    <prefix>:{shares}:total       string bytes held, all tenants
    <prefix>:{shares}:clock       string one tick per reserve or touch
    <prefix>:{shares}:tenants     set    every tenant charged or refused
    <prefix>:{shares}:lru:<name>  zset   the tenant's blocks by last use
    <prefix>:{shares}:t:<name>    hash   num_blocks and the counters of COUNTERS

A block's score is its last use's tick times 65536 less its index in its
chain (a call's uses, one per chain it writes or touches, get a tick each,
in order): of the blocks one store or one restore used, the deepest goes
first, so a chain loses its tail before its head, and an older chain goes
before a newer one. A new block over its tenant's
cap evicts that tenant's oldest blocks; over ``remote_max_bytes`` (summed
over the tenants), the oldest block of the tenant the most bytes over its
floor, the new block counted (when that is its own tenant and it holds
nothing else, the block is refused: no tenant under it gives for it);
once no tenant is over its floor, the largest tenant's. Choosing the tenant
reads the floored tenants and the largest unfloored one: O(floors + log
tenants). A block larger than its tenant's cap alone is refused. Per
tenant: stored = held + evicted + removed; refused counts what never came in.
"""

from __future__ import annotations

TAG = "{shares}"
DEPTH = 65536  # a score's ticks: room for the index of a block in its chain

_LUA_COMMON = """
local base = ARGV[1]
local owners, sizes, total = KEYS[1], base .. 'size', base .. 'total'
local function held(t) return tonumber(redis.call('ZSCORE', sizes, t) or '0') end
local function charge(t, name, nb, score)
  redis.call('HSET', owners, name, nb .. ':' .. t)
  redis.call('ZADD', base .. 'lru:' .. t, score, name)
  redis.call('ZINCRBY', sizes, nb, t)
  redis.call('INCRBY', total, nb)
  redis.call('SADD', base .. 'tenants', t)
  redis.call('HINCRBY', base .. 't:' .. t, 'num_blocks', 1)
  redis.call('HINCRBY', base .. 't:' .. t, 'num_stored', 1)
end
local function drop(name, why)
  local rec = redis.call('HGET', owners, name)
  if not rec then return nil end
  local at = string.find(rec, ':', 1, true)
  local nb, t = tonumber(string.sub(rec, 1, at - 1)), string.sub(rec, at + 1)
  redis.call('HDEL', owners, name)
  redis.call('ZREM', base .. 'lru:' .. t, name)
  if redis.call('ZINCRBY', sizes, -nb, t) + 0 <= 0 then redis.call('ZREM', sizes, t) end
  redis.call('DECRBY', total, nb)
  redis.call('HINCRBY', base .. 't:' .. t, 'num_blocks', -1)
  redis.call('HINCRBY', base .. 't:' .. t, why, 1)
  return t
end
"""

# ARGV: base, budget, #floors, (tenant, floor)..., #caps, (tenant, cap)..., the
# number of uses, then (name, tenant, bytes, order)... (shares.ranked). Reply: a
# status per block (1 charged, 0 held already, -1 refused), then the evicted
# blocks' names.
RESERVE = (
    _LUA_COMMON
    + """
local budget, floors, caps, at = tonumber(ARGV[2]), {}, {}, 4
for _ = 1, tonumber(ARGV[3]) do floors[ARGV[at]] = tonumber(ARGV[at + 1]); at = at + 2 end
local ncaps = tonumber(ARGV[at]); at = at + 1
for _ = 1, ncaps do caps[ARGV[at]] = tonumber(ARGV[at + 1]); at = at + 2 end
local nfloors = tonumber(ARGV[3])
local out, victims = {}, {}
local nsteps = tonumber(ARGV[at]); at = at + 1
local now = (redis.call('INCRBY', base .. 'clock', nsteps) - nsteps + 1) * 65536
local function oldest(t)
  local first = redis.call('ZRANGE', base .. 'lru:' .. t, 0, 0)
  return first[1]
end
local function evict(t, why)
  local name = oldest(t)
  if not name then return false end
  drop(name, 'num_evicted')
  if why then redis.call('HINCRBY', base .. 't:' .. t, why, 1) end
  victims[#victims + 1] = name
  return true
end
local function most_over(me, nb)
  local best, most = nil, 0
  for t, floor in pairs(floors) do
    local over = held(t) + (t == me and nb or 0) - floor
    if over > most then best, most = t, over end
  end
  local top = redis.call('ZREVRANGE', sizes, 0, nfloors, 'WITHSCORES')
  for i = 1, #top, 2 do
    if not floors[top[i]] then
      local over = tonumber(top[i + 1]) + (top[i] == me and nb or 0)
      if over > most then best, most = top[i], over end
      break
    end
  end
  if not floors[me] and held(me) + nb > most then best, most = me, held(me) + nb end
  if best then return best end
  return redis.call('ZREVRANGE', sizes, 0, 0)[1]
end
while at <= #ARGV do
  local name, t, nb = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local score = now + tonumber(ARGV[at + 3])
  at = at + 4
  local rec = redis.call('HGET', owners, name)
  local status = 1
  if rec then
    local t0 = string.sub(rec, string.find(rec, ':', 1, true) + 1)
    redis.call('ZADD', base .. 'lru:' .. t0, 'XX', score, name)
    status = 0
  elseif caps[t] and nb > caps[t] then
    status = -1
  else
    while caps[t] and held(t) + nb > caps[t] and evict(t, 'num_cap_evictions') do end
    if caps[t] and held(t) + nb > caps[t] then status = -1 end
    while status == 1 and budget > 0 and tonumber(redis.call('GET', total) or '0') + nb > budget do
      local from = most_over(t, nb)
      if not from or not evict(from, nil) then break end
    end
    if status == 1 and budget > 0 and tonumber(redis.call('GET', total) or '0') + nb > budget then
      status = -1
    end
  end
  if status == 1 then charge(t, name, nb, score) end
  if status == -1 then
    redis.call('SADD', base .. 'tenants', t)
    redis.call('HINCRBY', base .. 't:' .. t, 'num_refused', 1)
  end
  out[#out + 1] = status
end
for _, name in ipairs(victims) do out[#out + 1] = name end
return out
"""
)

# ARGV: base, the number of uses, (name, order)...: a newer score for the held ones.
TOUCH = (
    _LUA_COMMON
    + """
local nsteps = tonumber(ARGV[2])
local now = (redis.call('INCRBY', base .. 'clock', nsteps) - nsteps + 1) * 65536
local num = 0
for at = 3, #ARGV, 2 do
  local rec = redis.call('HGET', owners, ARGV[at])
  if rec then
    local t = string.sub(rec, string.find(rec, ':', 1, true) + 1)
    redis.call('ZADD', base .. 'lru:' .. t, 'XX', now + tonumber(ARGV[at + 1]), ARGV[at])
    num = num + 1
  end
end
return num
"""
)

# ARGV: base, names...: uncharge removed blocks. Reply: how many were charged.
RELEASE = (
    _LUA_COMMON
    + """
local num = 0
for at = 2, #ARGV do
  if drop(ARGV[at], 'num_removed') then num = num + 1 end
end
return num
"""
)
