"""The Lua scripts :class:`~forkyard.cluster.store.ClusterStore` runs on Redis, each one
atomic change of the cluster state (the keys: :mod:`forkyard.cluster.store`; the
placement index's scripts: :mod:`.rooms`; the list indexes': :mod:`.listing`). Each
comment gives the script's KEYS and ARGV and what it returns."""

from __future__ import annotations

from forkyard.cluster.listing import LUA_INDEX
from forkyard.cluster.rooms import LUA_INDEX_REPORT, LUA_ROOM

# The digest of each node's binding set (``fy:nodedig:<node>``: XOR of the first 64 bits
# of SHA-1 of every id, 16 hex chars), flipped by every script that adds an id to or
# removes one from ``fy:nodesbx:<node>``; a heartbeat whose node holds the same digest
# needs no reconciling (:func:`forkyard.cluster.messages.held_digest` computes the node's).
LUA_DIGEST = """
local function fy_dig_flip(node, id)
  local h = redis.sha1hex(id)
  local key = 'fy:nodedig:' .. node
  local cur = redis.call('GET', key) or '0000000000000000'
  local a = bit.bxor(tonumber(string.sub(cur, 1, 8), 16), tonumber(string.sub(h, 1, 8), 16))
  local b = bit.bxor(tonumber(string.sub(cur, 9, 16), 16), tonumber(string.sub(h, 9, 16), 16))
  redis.call('SET', key, bit.tohex(a, 8) .. bit.tohex(b, 8))
end
"""
# KEYS: nodesbx   ARGV: node   Recomputes a node's digest from its set (after a full
# reconcile: heals a digest written before digests existed).
REDIGEST = LUA_DIGEST + """
redis.call('DEL', 'fy:nodedig:' .. ARGV[1])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do fy_dig_flip(ARGV[1], id) end
return redis.call('GET', 'fy:nodedig:' .. ARGV[1]) or '0000000000000000'
"""

# KEYS: sbx, gone, nodesbx, sandboxes   ARGV: node, state, record, now, id, committed
UPSERT = LUA_INDEX + LUA_DIGEST + """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local cur = redis.call('HGET', KEYS[1], 'node')
if cur and cur ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'state', ARGV[2], 'record', ARGV[3], 'updated', ARGV[4],
           'committed', ARGV[6])
fy_index(KEYS[1], ARGV[5], ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[1], 'moved')
if redis.call('SADD', KEYS[3], ARGV[5]) == 1 then fy_dig_flip(ARGV[1], ARGV[5]) end
redis.call('SADD', KEYS[4], ARGV[5])
return 1
"""
# KEYS: sbx, nodesbx, sandboxes   ARGV: node, id
DELETE = LUA_INDEX + LUA_DIGEST + """
local cur = redis.call('HGET', KEYS[1], 'node')
if cur ~= ARGV[1] then return 0 end
fy_unindex(KEYS[1], ARGV[2])
redis.call('DEL', KEYS[1])
if redis.call('SREM', KEYS[2], ARGV[2]) == 1 then fy_dig_flip(ARGV[1], ARGV[2]) end
redis.call('SREM', KEYS[3], ARGV[2])
return 1
"""
# KEYS: sbx, from nodesbx, to nodesbx   ARGV: from, to, id, now
REBIND = LUA_DIGEST + """
local cur = redis.call('HMGET', KEYS[1], 'node', 'state', 'committed')
if cur[1] ~= ARGV[1] or cur[2] ~= 'paused' or cur[3] == '0' then return 0 end
redis.call('HSET', KEYS[1], 'node', ARGV[2], 'updated', ARGV[4], 'moved', '1')
if redis.call('SREM', KEYS[2], ARGV[3]) == 1 then fy_dig_flip(ARGV[1], ARGV[3]) end
if redis.call('SADD', KEYS[3], ARGV[3]) == 1 then fy_dig_flip(ARGV[2], ARGV[3]) end
return 1
"""
NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000"

# KEYS: nodes, node hash   ARGV: id, url, report, boot, the node's own status, stamp ('' = Redis time),
#                           heartbeat timeout, placement TTL, binding tag (forkyard.cluster.nodekeys),
#                           P2P tag (of the report's endpoint id, '' without one),
#                           then the placement ids it acknowledges
# Records a heartbeat (the node is heard: no longer declared down). The status is the
# operator's (drain/undrain); a node registering anew (or after Redis lost its data)
# brings its own view. The acknowledged placements stop counting and the node's room is
# indexed again (:mod:`.rooms`), in the same script: its report shows their sandboxes.
# Returns {status, 1 if it was declared down}.
HEARTBEAT = LUA_ROOM + LUA_INDEX_REPORT + """
local rnow = fy_time()
local now = rnow
if ARGV[6] ~= '' then now = tonumber(ARGV[6]) end
redis.call('SADD', KEYS[1], ARGV[1])
local was_down = redis.call('HEXISTS', KEYS[2], 'down_at')
redis.call('HSET', KEYS[2], 'url', ARGV[2], 'report', ARGV[3], 'boot', ARGV[4],
           'last_seen', string.format('%.6f', now), 'tag', ARGV[9], 'p2ptag', ARGV[10])
redis.call('HDEL', KEYS[2], 'down_at', 'grace_until')
redis.call('ZADD', 'fy:seen', now, ARGV[1])
redis.call('HSETNX', KEYS[2], 'status', ARGV[5])
fy_index_report(ARGV[1], cjson.decode(ARGV[3]))
if #ARGV > 10 then
  local ids = {unpack(ARGV, 11)}
  redis.call('ZREM', 'fy:placing:' .. ARGV[1], unpack(ids))
  redis.call('HDEL', 'fy:placingn:' .. ARGV[1], unpack(ids))
end
fy_room(ARGV[1], rnow, tonumber(ARGV[7]), tonumber(ARGV[8]))
return {redis.call('HGET', KEYS[2], 'status'), was_down,
        redis.call('GET', 'fy:nodedig:' .. ARGV[1]) or '0000000000000000'}
"""

# KEYS: sweeper lease, epoch, seen, nodes   ARGV: replica id, lease ttl (ms), heartbeat timeout (s)
# One sweep's first call (forkyard.cluster.scheduler.sweep_once): takes or renews the
# sweeper lease for this replica (only its holder sweeps: one sweep per control plane,
# however many replicas), records the state's epoch unless set, and says whether the
# whole sweep is needed: some node silent past the timeout by ``fy:seen`` (last heartbeat
# per node, Redis time) or a node registered without an entry there (a record written
# before the index, or by hand). Returns {1 if this replica holds the lease, TIME sec,
# TIME usec, 1 if a full sweep is needed}.
SWEEP_LEASE = NOW + """
local cur = redis.call('GET', KEYS[1])
local held = 0
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) held = 1
elseif cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) held = 1
end
redis.call('SET', KEYS[2], string.format('%.6f', now), 'NX')
local full = 0
if held == 1 then
  if redis.call('ZCARD', KEYS[3]) ~= redis.call('SCARD', KEYS[4]) then full = 1
  elseif #redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - tonumber(ARGV[3])), 'LIMIT', 0, 1) > 0 then
    full = 1
  end
end
return {held, t[1], t[2], full}
"""

# KEYS: node hash, nodesbx, sandboxes   ARGV: prefix, healthy_since, timeout, tombstone ttl,
#                                             death keep (s), why
# Declares the node down if it is still silent past the timeout, counted from the later
# of its last heartbeat and healthy_since (Redis time: see forkyard.cluster.liveness), and
# not within a restart grace it announced, and
# replaces the bindings of its sandboxes that are not paused by tombstones (their node
# stops them when it is back), each with the cause for the gateway's 404. Destroys
# nothing. Returns {'heard'} (nothing changed) or {'down', id, ...} (the tombstoned ids).
MARK_DOWN = NOW + LUA_INDEX + LUA_DIGEST + """
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seen') or '0')
local since = math.max(last, tonumber(ARGV[2]))
if now - since <= tonumber(ARGV[3]) then return {'heard'} end
if now < tonumber(redis.call('HGET', KEYS[1], 'grace_until') or '0') then return {'heard'} end
if redis.call('HEXISTS', KEYS[1], 'down_at') == 0 then
  redis.call('HSET', KEYS[1], 'down_at', string.format('%.6f', now))
end
redis.call('ZREM', ARGV[1] .. 'place', string.sub(KEYS[1], string.len(ARGV[1]) + 6))
local gone = {'down'}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local key = ARGV[1] .. 'sbx:' .. id
  local state = redis.call('HGET', key, 'state')
  if state ~= 'paused' then
    fy_unindex(key, id)
    redis.call('DEL', key)
    if redis.call('SREM', KEYS[2], id) == 1 then fy_dig_flip(string.sub(KEYS[1], string.len(ARGV[1]) + 6), id) end
    redis.call('SREM', KEYS[3], id)
    redis.call('SET', ARGV[1] .. 'gone:' .. id, '1', 'EX', ARGV[4])
    redis.call('SET', ARGV[1] .. 'dead:' .. id, ARGV[6], 'EX', ARGV[5])
    table.insert(gone, id)
  end
end
return gone
"""


# KEYS: placing zset, placingn hash   ARGV: cutoff
# Drops placements older than the cutoff; returns the sandbox count of the rest.
PENDING = """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if #old > 0 then
  redis.call('ZREM', KEYS[1], unpack(old))
  redis.call('HDEL', KEYS[2], unpack(old))
end
local n = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do n = n + tonumber(v) end
return n
"""


# ---- volume leases (forkyard.cluster.volumes) ----------------------------------------
# A lease holds while its node is registered and not declared down, and for a takeover
# time after it was declared down (its sandboxes may still run on its host): a lease
# never ends on a timer while its node is heard, so an outage of Redis or of the
# scheduler (during which no one can take a lease) frees nothing.
# fy_holds(prefix, node, now, takeover s) says whether a lease of ``node`` still holds;
# fy_live(prefix, node) whether ``node`` may take one.
LUA_HOLDER = """
local function fy_live(prefix, node)
  local h = prefix .. 'node:' .. node
  return redis.call('EXISTS', h) == 1 and redis.call('HEXISTS', h, 'down_at') == 0
end
local function fy_holds(prefix, node, now, takeover)
  local h = prefix .. 'node:' .. node
  if redis.call('EXISTS', h) == 0 then return false end
  local down = redis.call('HGET', h, 'down_at')
  return (not down) or now - tonumber(down) < takeover
end
"""
# KEYS: vlease:<id>, node:<requester>   ARGV: prefix, node, volume id, volume name, takeover s
# Grants the lease of a volume to a node when no node holds it (or it holds it already);
# a node that is not registered or is declared down gets none.
# Returns {'ok', node} | {'held', holder} | {'refused', ''}.
VOLUME_ACQUIRE = NOW + LUA_HOLDER + """
if not fy_live(ARGV[1], ARGV[2]) then return {'refused', ''} end
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[2] and fy_holds(ARGV[1], cur, now, tonumber(ARGV[5])) then return {'held', cur} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', ARGV[1] .. 'vname:' .. ARGV[4], ARGV[3])
return {'ok', ARGV[2]}
"""
# KEYS: vlease:<id>   ARGV: node   Drops the lease if that node holds it; returns 1 if so.
VOLUME_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""
# ARGV: prefix, takeover s, then 'i:<volume id>' or 'n:<volume name>' items. Returns the
# holder of each ('' when none holds it).
VOLUME_HOLDERS = NOW + LUA_HOLDER + """
local out = {}
for i = 3, #ARGV do
  local kind, v = string.sub(ARGV[i], 1, 1), string.sub(ARGV[i], 3)
  local vid = v
  if kind == 'n' then vid = redis.call('GET', ARGV[1] .. 'vname:' .. v) end
  local holder = ''
  if vid then
    local cur = redis.call('GET', ARGV[1] .. 'vlease:' .. vid)
    if cur and fy_holds(ARGV[1], cur, now, tonumber(ARGV[2])) then holder = cur end
  end
  table.insert(out, holder)
end
return out
"""
# KEYS: p2powners   ARGV: endpoint id, expected owner ('' none), new owner ('' none)
# The node a P2P endpoint id is vouched for (:class:`~forkyard.cluster.p2p.PeerTable`),
# changed only while it is still ``expected`` (two schedulers at once: one wins).
# Returns the owner after ('' none).
P2P_OWNER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if cur ~= ARGV[2] then return cur end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return ARGV[3]
"""
