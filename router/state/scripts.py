"""The Lua scripts behind every atomic shared-state update, loaded once with SCRIPT LOAD.

Times come from the Redis clock (TIME), so leases and `last_seen` agree across replicas
whatever their own clocks say. Floats are stored with 17 significant digits so they round-trip
exactly. The session and refresh scripts touch keys named inside the script (from the prefixes
passed in ARGV); on Redis Cluster those keys share the hash slot of the keys the call names
(`router.state.keys`), which is what the cluster requires of a script. The session scripts'
one key is their bucket's prefix, there only to route the call.

Ledger admission rule (`reserve`): expired leases are pruned first; a "handoff" reservation is
always admitted; a "migration" of `nbytes` is admitted iff

    handoff_bytes + migration_bytes + nbytes <= rate x lease_s

where the sums are over unexpired reservations of every replica and `rate` is the link's
capacity_bps, or its observed_bps while no capacity is known; with neither known, a migration
is admitted only onto an idle link (no unexpired reservation).
"""

from __future__ import annotations

import hashlib

_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function extend(key, ttl)
  local left = redis.call('PTTL', key)
  if left == -1 or (left >= 0 and left < ttl) then redis.call('PEXPIRE', key, ttl) end
end
local function num(x) return string.format('%.17g', x) end
-- prunes expired leases; returns the unexpired bytes by class (ids start with h or m), count
local function ledger(leases, resv, now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  for i = 1, #expired, 500 do
    redis.call('HDEL', resv, unpack(expired, i, math.min(i + 499, #expired)))
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', leases, '-inf', now) end
  -- every script adds and removes an id in both keys together, so what is left is live
  local live = redis.call('HGETALL', resv)
  local h, m = 0, 0
  for i = 1, #live, 2 do
    local b = tonumber(live[i + 1])
    if string.byte(live[i], 1) == 104 then h = h + b else m = m + b end
  end
  return h, m, #live / 2
end
"""

# Every session write of a batch in one call (the per-command cost of a client library is
# paid once per batch, not once per turn). ARGV: session key prefix, ttl ms, channel, replica,
# then a msgpack array of writes, each [session id, expected epoch, epoch increment, turns
# increment, owner ('' clears the residency), tokens, bytes, write id]. Reply: a msgpack array
# of [ok, owner, tokens, bytes, turns, epoch, last_seen], the stored record after each write.
# The writes that changed a record go out as ONE invalidation message per call, [replica,
# [[session id, epoch, owner, tokens, bytes, turns, last_seen], ...]]: a subscriber pays its
# client library's per-message cost once per batch, not once per turn.
SESSION_CAS_BATCH = """
local prefix, ttl, channel, replica = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local writes = cmsgpack.unpack(ARGV[5])
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local out, changed = {}, {}
for i = 1, #writes do
  local w = writes[i]
  local sid, expected, owner_new, tokens, nbytes, write_id = w[1], w[2], w[5], w[6], w[7], w[8]
  local key = prefix .. sid
  local cur = redis.call('HMGET', key, 'owner', 'tokens', 'bytes', 'turns', 'epoch', 'last_seen',
                         'write_id')
  local epoch = tonumber(cur[5]) or 0
  local owner = cur[1] or ''
  if epoch ~= expected and not (expected == 0 and owner == '') then
    -- a retried write that an earlier, unacknowledged attempt already applied
    local ok = 0
    if cur[7] == write_id then ok = 1 end
    out[i] = {ok, owner, tonumber(cur[2]) or 0, tonumber(cur[3]) or 0, tonumber(cur[4]) or 0,
              epoch, cur[6] or '0'}
  elseif owner_new == '' and not cur[5] then
    out[i] = {1, '', 0, 0, 0, 0, '0'}
  else
    local new_epoch = epoch + w[3]
    local turns = (tonumber(cur[4]) or 0) + w[4]
    if owner_new == '' then tokens = 0; nbytes = 0 end
    redis.call('HSET', key, 'owner', owner_new, 'tokens', tokens, 'bytes', nbytes, 'turns',
               turns, 'epoch', new_epoch, 'last_seen', now, 'write_id', write_id)
    redis.call('PEXPIRE', key, ttl)
    changed[#changed + 1] = {sid, new_epoch, owner_new, tokens, nbytes, turns, tonumber(now)}
    out[i] = {1, owner_new, tokens, nbytes, turns, new_epoch, now}
  end
end
if #changed > 0 then
  redis.call('PUBLISH', channel, cmsgpack.pack({replica, changed}))
end
return cmsgpack.pack(out)
"""

# After an outage, a replica writes back the sessions its local view holds (Redis may have come
# back empty). ARGV: session key prefix, ttl ms, channel, replica, then a msgpack array of
# [session id, epoch, owner, tokens, bytes, turns, last_seen]. Each is set only where Redis
# holds no record of the session or an older epoch (never over a newer write, whichever replica
# writes back first), expiring `ttl` after its last_seen, and published like a commit. Reply: a
# msgpack array of [applied, owner, tokens, bytes, turns, epoch, last_seen], the stored record
# after each.
SESSION_RESTORE_BATCH = """
local prefix, ttl, channel, replica = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local entries = cmsgpack.unpack(ARGV[5])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out, changed = {}, {}
for i = 1, #entries do
  local e = entries[i]
  local sid, epoch, owner, tokens, nbytes, turns, seen = e[1], e[2], e[3], e[4], e[5], e[6], e[7]
  local key = prefix .. sid
  local cur = redis.call('HMGET', key, 'owner', 'tokens', 'bytes', 'turns', 'epoch', 'last_seen')
  local stored = tonumber(cur[5])
  local left = ttl - (now_ms - math.floor(tonumber(seen) * 1000))
  if (stored and stored >= epoch) or left <= 0 then
    out[i] = {0, cur[1] or '', tonumber(cur[2]) or 0, tonumber(cur[3]) or 0,
              tonumber(cur[4]) or 0, stored or 0, cur[6] or '0'}
  else
    redis.call('HSET', key, 'owner', owner, 'tokens', tokens, 'bytes', nbytes, 'turns', turns,
               'epoch', epoch, 'last_seen', seen, 'write_id', '')
    redis.call('PEXPIRE', key, math.min(ttl, left))
    changed[#changed + 1] = {sid, epoch, owner, tokens, nbytes, turns, tonumber(seen)}
    out[i] = {1, owner, tokens, nbytes, turns, epoch, seen}
  end
end
if #changed > 0 then
  redis.call('PUBLISH', channel, cmsgpack.pack({replica, changed}))
end
return cmsgpack.pack(out)
"""

# KEYS: worker hash, workers index. ARGV: worker id, record blob, scraped_at, ttl ms.
# An older scrape never overwrites a newer one written by another replica.
WORKER_PUT = """
local at = tonumber(redis.call('HGET', KEYS[1], 'at'))
if at and at > tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], 'blob', ARGV[2], 'at', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
extend(KEYS[2], tonumber(ARGV[4]))
return 1
"""

# KEYS: link hash, links index. ARGV: link id, src, dst, capacity_bps, ttl ms.
LINK_CAPACITY = """
local ttl = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'src', ARGV[2], 'dst', ARGV[3], 'capacity_bps', ARGV[4])
extend(KEYS[1], ttl)
redis.call('SADD', KEYS[2], ARGV[1])
extend(KEYS[2], ttl)
return 1
"""

# KEYS: link hash, leases, reservation bytes, links index. ARGV: link id, src, dst,
# reservation id, nbytes, lease ms, ttl ms.
# Reply: admitted, expires ms, handoff bytes, migration bytes, count, capacity, observed, now ms.
LINK_RESERVE = """
local now = now_ms()
local h, m, n = ledger(KEYS[2], KEYS[3], now)
local meta = redis.call('HMGET', KEYS[1], 'capacity_bps', 'observed_bps')
local cap, obs = tonumber(meta[1]) or 0, tonumber(meta[2]) or 0
local nbytes, lease = tonumber(ARGV[5]), tonumber(ARGV[6])
local handoff = string.byte(ARGV[4], 1) == 104
local admit = true
if not handoff then
  local rate = cap
  if rate <= 0 then rate = obs end
  if rate > 0 then admit = h + m + nbytes <= rate * lease / 1000 else admit = n == 0 end
end
local expires = now + lease
if admit then
  local ttl = math.max(tonumber(ARGV[7]), lease)
  redis.call('ZADD', KEYS[2], expires, ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
  redis.call('HSET', KEYS[1], 'src', ARGV[2], 'dst', ARGV[3])
  extend(KEYS[1], ttl); extend(KEYS[2], ttl); extend(KEYS[3], ttl)
  redis.call('SADD', KEYS[4], ARGV[1])
  extend(KEYS[4], ttl)
  if handoff then h = h + nbytes else m = m + nbytes end
  n = n + 1
end
return {admit and 1 or 0, expires, h, m, n, num(cap), num(obs), now}
"""

# KEYS: link hash, leases, reservation bytes, links index. ARGV: link id, src, dst,
# reservation id, observed rate ('' for no sample), alpha, ttl ms.
# Reply: handoff bytes, migration bytes, count, capacity, observed, now ms.
LINK_RELEASE = """
local now = now_ms()
redis.call('ZREM', KEYS[2], ARGV[4])
redis.call('HDEL', KEYS[3], ARGV[4])
local h, m, n = ledger(KEYS[2], KEYS[3], now)
local meta = redis.call('HMGET', KEYS[1], 'capacity_bps', 'observed_bps')
local obs = meta[2] or '0'
if ARGV[5] ~= '' then
  local rate, old, a = tonumber(ARGV[5]), tonumber(meta[2]), tonumber(ARGV[6])
  local new = rate
  if old then new = a * rate + (1 - a) * old end
  obs = num(new)
  local ttl = tonumber(ARGV[7])
  redis.call('HSET', KEYS[1], 'src', ARGV[2], 'dst', ARGV[3], 'observed_bps', obs)
  extend(KEYS[1], ttl)
  redis.call('SADD', KEYS[4], ARGV[1])
  extend(KEYS[4], ttl)
end
return {h, m, n, meta[1] or '0', obs, now}
"""

# KEYS: workers index, replicas index, links index, own in-flight hash. ARGV: worker, in-flight,
# link, lease and reservation key prefixes, own replica id, in-flight ttl ms, then own
# (worker id, count) pairs. Writes this replica's heartbeat, drops index entries whose records
# expired, and reads everything else.
# Reply: now ms, worker blobs, other replicas' in-flight summed (flat pairs), link rows.
REFRESH = """
local now = now_ms()
local own = KEYS[4]
redis.call('DEL', own)
if #ARGV > 7 then
  for i = 8, #ARGV, 500 do
    redis.call('HSET', own, unpack(ARGV, i, math.min(i + 499, #ARGV)))
  end
  redis.call('PEXPIRE', own, ARGV[7])
  redis.call('SADD', KEYS[2], ARGV[6])
  extend(KEYS[2], tonumber(ARGV[7]))
end
local workers = {}
local ids = redis.call('SMEMBERS', KEYS[1])
for i = 1, #ids do
  local blob = redis.call('HGET', ARGV[1] .. ids[i], 'blob')
  if blob then workers[#workers + 1] = blob else redis.call('SREM', KEYS[1], ids[i]) end
end
local sums, order = {}, {}
local rids = redis.call('SMEMBERS', KEYS[2])
for i = 1, #rids do
  if rids[i] ~= ARGV[6] then
    local flat = redis.call('HGETALL', ARGV[2] .. rids[i])
    if #flat == 0 then redis.call('SREM', KEYS[2], rids[i]) end
    for j = 1, #flat, 2 do
      local w = flat[j]
      if sums[w] == nil then sums[w] = 0; order[#order + 1] = w end
      sums[w] = sums[w] + tonumber(flat[j + 1])
    end
  end
end
local inflight = {}
for i = 1, #order do
  inflight[#inflight + 1] = order[i]
  inflight[#inflight + 1] = sums[order[i]]
end
local links = {}
local lids = redis.call('SMEMBERS', KEYS[3])
for i = 1, #lids do
  local meta = redis.call('HMGET', ARGV[3] .. lids[i], 'src', 'dst', 'capacity_bps',
                          'observed_bps')
  if meta[1] then
    local h, m, n = ledger(ARGV[4] .. lids[i], ARGV[5] .. lids[i], now)
    links[#links + 1] = {meta[1], meta[2], meta[3] or '0', meta[4] or '0', h, m, n}
  else
    redis.call('SREM', KEYS[3], lids[i])
  end
end
return {now, workers, inflight, links}
"""

_SOURCES = {
    "session_cas_batch": SESSION_CAS_BATCH,
    "session_restore_batch": SESSION_RESTORE_BATCH,
    "worker_put": WORKER_PUT,
    "link_capacity": LINK_CAPACITY,
    "link_reserve": LINK_RESERVE,
    "link_release": LINK_RELEASE,
    "refresh": REFRESH,
}


class Scripts:
    """The SHA1 of each script (known locally, so EVALSHA needs no prior reply)."""

    def __init__(self) -> None:
        self.sources = {name: _PRELUDE + body for name, body in _SOURCES.items()}
        sha = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in self.sources.items()}
        self.shas = list(sha.values())
        self.session_cas_batch = sha["session_cas_batch"]
        self.session_restore_batch = sha["session_restore_batch"]
        self.worker_put = sha["worker_put"]
        self.link_capacity = sha["link_capacity"]
        self.link_reserve = sha["link_reserve"]
        self.link_release = sha["link_release"]
        self.refresh = sha["refresh"]
