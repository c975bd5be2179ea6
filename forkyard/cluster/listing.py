"""Listing sandboxes cluster-wide by pages (issue 26): secondary indexes kept on every
write, and cursors that read only the page.

Keys (sorted sets of sandbox ids scored by ``started_at``, UNIX s; equal scores order by
id, so an index's order is the list's ``(started_at, id)``):

==============================  ==========================================================
``fy:ix:all``                   every bound sandbox
``fy:ix:s:<running|paused>``    by visible state (``running`` covers every state but
                                ``paused``, as E2B's list does)
``fy:ix:t:<template id>``       by template
``fy:ix:m:<len(k)>:<k>=<v>``    by metadata pair (the key's length first: keys and
                                values may hold any character)
``fy:sbx:<id>`` field ``ix``    the index keys the binding is in (JSON), so a change or
                                a delete touches only those
==============================  ==========================================================

The store's binding scripts (:mod:`.store`: upsert, delete, declaration of a node down)
call :data:`LUA_INDEX` in the same script as the change, so the indexes never disagree
with the bindings. A page (:func:`read_page`) walks the most selective index the filters
name from the cursor on, reading records in batches and checking every filter on each
(:func:`forkyard.api.routes_sandboxes.filter_records`), until it has ``limit`` of them:
its cost follows the page, not the number of sandboxes (a filter whose matches are rare
in the index walked reads more). The cursor (E2B's opaque ``nextToken`` /
``x-next-token``) is the last item's ``(started_at, id)``.
"""

from __future__ import annotations

import base64
import json

from forkyard.orchestrator.errors import BadRequest

#: Records read per batch of a page walk after the first (which reads ``limit + 1``).
BATCH = 200

# fy_index(key, id, state, record json): (re)index one binding; fy_unindex(key, id):
# remove it from every index it is in (before its hash is deleted).
LUA_INDEX = """
local function fy_unindex(key, id)
  local old = redis.call('HGET', key, 'ix')
  if old then
    for _, k in ipairs(cjson.decode(old)) do redis.call('ZREM', k, id) end
  end
end
local function fy_index(key, id, state, record)
  local ok, rec = pcall(cjson.decode, record)
  if not ok or type(rec) ~= 'table' then rec = {} end
  local score = string.format('%.6f', tonumber(rec.started_at) or 0)
  local vis = 'running'
  if state == 'paused' then vis = 'paused' end
  local keys = {'fy:ix:all', 'fy:ix:s:' .. vis}
  if type(rec.template_id) == 'string' then table.insert(keys, 'fy:ix:t:' .. rec.template_id) end
  if type(rec.metadata) == 'table' then
    for k, v in pairs(rec.metadata) do
      if type(k) == 'string' and type(v) == 'string' then
        table.insert(keys, 'fy:ix:m:' .. string.len(k) .. ':' .. k .. '=' .. v)
      end
    end
  end
  local keep = {}
  for _, k in ipairs(keys) do keep[k] = true end
  local old = redis.call('HGET', key, 'ix')
  if old then
    for _, k in ipairs(cjson.decode(old)) do
      if not keep[k] then redis.call('ZREM', k, id) end
    end
  end
  for _, k in ipairs(keys) do redis.call('ZADD', k, score, id) end
  redis.call('HSET', key, 'ix', cjson.encode(keys))
end
"""

# Index bindings written before the indexes existed. ARGV: ids. Returns how many.
INDEX_EXISTING = LUA_INDEX + """
local n = 0
for _, id in ipairs(ARGV) do
  local key = 'fy:sbx:' .. id
  local h = redis.call('HMGET', key, 'state', 'record', 'ix')
  if h[2] and not h[3] then
    fy_index(key, id, h[1] or '', h[2])
    n = n + 1
  end
end
return n
"""


def metadata_key(k: str, v: str) -> str:
    """The index key of metadata pair ``k=v``."""
    return f"fy:ix:m:{len(k)}:{k}={v}"


def encode_cursor(score: float, sandbox_id: str) -> str:
    """The ``x-next-token`` after the item ``(score, sandbox_id)``."""
    return base64.urlsafe_b64encode(f"{score!r}:{sandbox_id}".encode()).decode()


def decode_cursor(token: str) -> tuple[float, str]:
    """``(started_at, id)`` of a token from :func:`encode_cursor`.

    Raises:
        BadRequest: not a token the gateway issued.
    """
    try:
        score, sid = base64.urlsafe_b64decode(token.encode()).decode().split(":", 1)
        return float(score), sid
    except Exception as e:  # noqa: BLE001 — any decoding failure is the client's
        raise BadRequest("invalid nextToken") from e


def choose_index(states: set[str], want: dict[str, str], template: str | None, sizes: dict[str, int]) -> str:
    """The index to walk: the smallest of those the filters name (``sizes``: each
    candidate key's ``ZCARD``, from :func:`candidate_indexes`)."""
    return min(candidate_indexes(states, want, template), key=lambda k: sizes.get(k, 0))


def candidate_indexes(states: set[str], want: dict[str, str], template: str | None) -> list[str]:
    """Index keys any of which holds every match of the filters."""
    keys = [metadata_key(k, v) for k, v in want.items()]
    if template:
        keys.append(f"fy:ix:t:{template.split(':', 1)[0]}")
    keys.append(f"fy:ix:s:{next(iter(states))}" if len(states) == 1 else "fy:ix:all")
    return keys


async def read_page(r, key: str, desc: bool, after: float | None, before: float | None,
                    cursor: tuple[float, str] | None, limit: int, accept) -> tuple[list[tuple[float, str, dict]], bool]:
    """Walk index ``key`` from ``cursor`` (exclusive) in ``(started_at, id)`` order
    (``desc``: newest first), start times within ``after`` … ``before`` (inclusive),
    reading each id's binding (``HGETALL fy:sbx:<id>``) and keeping those ``accept(row)``
    takes (``row``: the hash, decoded), until ``limit`` are kept.

    Returns:
        ``([(started_at, id, row), …], more)``: ``more`` when the index holds further
        items after the last one kept (the caller issues a cursor then).
    """
    lo = "-inf" if after is None else repr(after)
    hi = "+inf" if before is None else repr(before)
    if cursor is not None:
        if desc:
            hi = repr(min(cursor[0], before)) if before is not None else repr(cursor[0])
        else:
            lo = repr(max(cursor[0], after)) if after is not None else repr(cursor[0])
    out: list[tuple[float, str, dict]] = []
    bound_score, run = None, 0  # items already seen at the current bound score
    first = True
    while True:
        # the first batch is the page itself (+1: is there more?); later ones, when
        # filters refused some, BATCH at a time
        n = limit + 1 + (cursor is not None) if first else BATCH
        first = False
        start, stop = (hi, lo) if desc else (lo, hi)
        if bound_score is not None:
            start = repr(bound_score)
        got = await r.zrange(key, start, stop, byscore=True, desc=desc, offset=run, num=n, withscores=True)
        if not got:
            return out, False
        items = []
        for member, score in got:
            sid = member.decode() if isinstance(member, bytes) else member
            if cursor is not None and score == cursor[0] and (sid >= cursor[1] if desc else sid <= cursor[1]):
                continue  # at or before the cursor
            items.append((score, sid))
        last = got[-1][1]
        run = (run if bound_score == last else 0) + sum(1 for _, s in got if s == last)
        bound_score = last
        if items:
            async with r.pipeline(transaction=False) as p:
                for _, sid in items:
                    p.hgetall(f"fy:sbx:{sid}")
                rows = await p.execute()
            for (score, sid), row in zip(items, rows):
                if not row:
                    continue  # deleted meanwhile
                row = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                       for k, v in row.items()}
                if accept(row):
                    if len(out) == limit:
                        return out, True
                    out.append((score, sid, row))
        if len(got) < n:
            return out, False


def record_of(row: dict) -> dict:
    """The published record in a binding's hash (``{}`` when unreadable)."""
    try:
        rec = json.loads(row.get("record", "{}"))
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}
