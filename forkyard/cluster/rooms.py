"""Room on nodes, taken atomically (issue 26): the placement index and reservations.

A placement must never put more sandboxes on a node than it has room for, whatever the
number of concurrent requests or scheduler replicas. The room of a node is
``max_sandboxes − running − placing`` (``placing``: sandboxes placed there that its
heartbeats have not acknowledged yet, :data:`~.store.PLACING_TTL_S` at most), and it is
checked and taken by **one Lua script** (:data:`RESERVE`): Redis runs scripts one at a
time, so two reservations can never both see the last free place.

Keys (beside :mod:`.store`'s):

==============================  =======================================================
``fy:place``                    sorted set of the nodes that can take a sandbox (up, not
                                declared down, heard within the heartbeat timeout, room
                                left), scored by the placement score of a 2-vCPU sandbox
                                (:mod:`.placement`); kept by every script that changes a
                                node's room, read with one ``ZRANGE`` per placement
``fy:snapnodes:<snapshot id>``  set of the nodes whose cache holds that snapshot (locality),
                                changed only when a node's cached list changes
``fy:node:<id>`` fields         ``max_sbx``, ``running``, ``vcpus``, ``vres``, ``load1``
                                (from its last report), ``placing`` (the sum above, as of
                                the last script that touched the node), ``snaps`` (the
                                cached list as last indexed)
==============================  =======================================================

So a placement costs a constant number of Redis calls whatever the fleet's size: one
read of the best :data:`CANDIDATES` nodes (plus those caching the snapshot, and a fork's
source), one pipelined read of their hashes, one reservation. The index is a hint; the
script's own check is what counts, and a reservation that lost a race is planned again
(:func:`forkyard.cluster.scheduler` ``placements``).
"""

from __future__ import annotations

#: Best-scored nodes read per placement (more when a request needs more room): E2B
#: samples K=3 of its fleet (``placement_best_of_K``); reading the top 8 keeps the exact
#: least-busy choice among them while the read stays O(1) in the fleet's size.
CANDIDATES = 8

# Lua shared by the scripts below. ``fy_pending`` drops a node's placements older than
# the cutoff and sums the rest; ``fy_room`` recomputes one node's room and its place in
# ``fy:place`` (returns the free room, or -1 when the node cannot take sandboxes at all).
# Arguments are Redis time (s), the heartbeat timeout (s) and the placement TTL (s).
LUA_ROOM = """
local function fy_pending(nid, cutoff)
  local zk, hk = 'fy:placing:' .. nid, 'fy:placingn:' .. nid
  local old = redis.call('ZRANGEBYSCORE', zk, '-inf', cutoff)
  if #old > 0 then
    redis.call('ZREM', zk, unpack(old))
    redis.call('HDEL', hk, unpack(old))
  end
  local n = 0
  for _, v in ipairs(redis.call('HVALS', hk)) do n = n + tonumber(v) end
  return n
end
local function fy_room(nid, rnow, timeout, ttl)
  local key = 'fy:node:' .. nid
  local h = redis.call('HMGET', key, 'status', 'down_at', 'last_seen', 'max_sbx', 'running', 'vcpus', 'vres',
                       'load1')
  if not h[1] and not h[3] then redis.call('ZREM', 'fy:place', nid) return -1 end
  local placing = fy_pending(nid, rnow - ttl)
  redis.call('HSET', key, 'placing', placing)
  local free = tonumber(h[4] or '0') - tonumber(h[5] or '0') - placing
  local alive = rnow - tonumber(h[3] or '0') <= timeout
  if h[1] ~= 'up' or h[2] or not alive or not h[4] then
    redis.call('ZREM', 'fy:place', nid)
    return -1
  end
  if free <= 0 then
    redis.call('ZREM', 'fy:place', nid)
    return free
  end
  local vcpus = math.max(tonumber(h[6] or '1'), 1)
  local score = (2 + tonumber(h[7] or '0') + 2 * placing + 0.5 * tonumber(h[8] or '0')) / (4 * vcpus)
  redis.call('ZADD', 'fy:place', string.format('%.9f', score), nid)
  return free
end
local function fy_time()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# ARGV: heartbeat timeout, placement TTL, placement id, stamp ('' = Redis time),
#       force ('1': take it without checking: tests), then node id, count pairs.
# Checks that every node can take its count (up, heard, room) and only then takes the
# room on all of them (all or nothing). Returns {1} or {0, node id, its free room}.
RESERVE = LUA_ROOM + """
local timeout, ttl, pid = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local rnow = fy_time()
local stamp = rnow
if ARGV[4] ~= '' then stamp = tonumber(ARGV[4]) end
if ARGV[5] ~= '1' then
  for i = 6, #ARGV, 2 do
    local free = fy_room(ARGV[i], rnow, timeout, ttl)
    if free < tonumber(ARGV[i + 1]) then return {0, ARGV[i], free} end
  end
end
for i = 6, #ARGV, 2 do
  local nid = ARGV[i]
  redis.call('ZADD', 'fy:placing:' .. nid, string.format('%.6f', stamp), pid)
  redis.call('HSET', 'fy:placingn:' .. nid, pid, ARGV[i + 1])
  redis.call('EXPIRE', 'fy:placing:' .. nid, 120)
  redis.call('EXPIRE', 'fy:placingn:' .. nid, 120)
  fy_room(nid, rnow, timeout, ttl)
end
return {1}
"""

# ARGV: heartbeat timeout, placement TTL, node id, placement ids...
# Stops counting placements (acknowledged by the node, or given back) and re-indexes.
RELEASE = LUA_ROOM + """
local nid = ARGV[3]
if #ARGV > 3 then
  local ids = {unpack(ARGV, 4)}
  redis.call('ZREM', 'fy:placing:' .. nid, unpack(ids))
  redis.call('HDEL', 'fy:placingn:' .. nid, unpack(ids))
end
return fy_room(nid, fy_time(), tonumber(ARGV[1]), tonumber(ARGV[2]))
"""

# Called by the heartbeat script with the report decoded (``rep``) and the node id
# (``nid``): the fields ``fy_room`` reads, and the locality sets when the node's cached
# snapshot list changed (O(its cache) then, nothing otherwise).
LUA_INDEX_REPORT = """
local function fy_index_report(nid, rep)
  local key = 'fy:node:' .. nid
  redis.call('HSET', key, 'max_sbx', tonumber(rep.max_sandboxes) or 0, 'running', tonumber(rep.running) or 0,
             'vcpus', tonumber(rep.vcpus) or 1, 'vres', tonumber(rep.vcpus_reserved) or 0,
             'load1', string.format('%.3f', tonumber(rep.load1) or 0))
  local snaps = rep.cached_snapshots
  if type(snaps) ~= 'table' then snaps = {} end
  local enc = cjson.encode(snaps)
  local old = redis.call('HGET', key, 'snaps')
  if old ~= enc then
    if old then
      for _, s in ipairs(cjson.decode(old)) do redis.call('SREM', 'fy:snapnodes:' .. s, nid) end
    end
    for _, s in ipairs(snaps) do redis.call('SADD', 'fy:snapnodes:' .. tostring(s), nid) end
    redis.call('HSET', key, 'snaps', enc)
  end
end
"""
