"""Where each shard's primary and backup live: the chief's rebalancing, as a pure function.

:func:`rebalance` changes ``routing`` (shard -> primary) and ``backups`` (shard -> backup) in
place and returns what it did, one line per change, for the log. The rules:

- **The bound.** No live server is primary of more than ``ceil(shards / live servers)`` shards
  once the moves below have run (a busier one is *overloaded*; one under the bound has *room*).
- **Moves go through whole copies only.** A shard moves from an overloaded primary to its backup
  only when that backup has room, the chief recorded its copy as whole (``complete``) and the
  primary's latest heartbeat still lists it in sync (``in_sync``): replication is synchronous,
  so that backup holds every update the primary acknowledged, and no copy is made while the
  shard waits. The move is a swap of roles in the view; the servers fence on it (ps/host.py).
- **One move at a time per shard.** A moved shard has no backup (its old primary drops its copy
  on the view change); the refill (:func:`assign_backups`) gives it one, which must receive a
  whole copy before the shard can move again.
- **Backups are aimed where moves can go.** When an overloaded primary has no shard whose whole
  backup has room, the backup of one of its shards is re-aimed at the server with the most room
  (as many as it has shards over the bound); the move follows once that copy is whole.
- **Free shards.** Shards in ``placeable`` with no primary (never placed: the first servers
  took one each at their join) go to the least-loaded live server. A shard that lost every
  whole copy is not placeable here: ``--recovery`` decides (chief/state.py).

Nothing here reads a clock or a socket; chief/state.py calls it after every join, departure,
promotion and completed copy, and on its ticker.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, MutableMapping


def bound(num_shards: int, servers: int) -> int:
    """The most primaries one server may hold: ``ceil(shards / servers)`` (all of them with none)."""
    return math.ceil(num_shards / servers) if servers > 0 else num_shards


def primaries(routing: Mapping[int, str], live: Iterable[str]) -> dict[str, int]:
    """Primaries per live server (0 for one with none)."""
    out = {p: 0 for p in live}
    for p in routing.values():
        if p in out:
            out[p] += 1
    return out


def _load(routing: Mapping[int, str], backups: Mapping[int, str], live: list[str]) -> dict[str, tuple[int, int]]:
    """(primaries, copies) per live server: the order in which servers are chosen to take more."""
    prim = primaries(routing, live)
    copies = dict(prim)
    for b in backups.values():
        if b in copies:
            copies[b] += 1
    return {p: (prim[p], copies[p]) for p in live}


def assign_backups(routing: Mapping[int, str], backups: MutableMapping[int, str],
                   complete: MutableMapping[int, str], live: list[str]) -> list[str]:
    """Gives every routed shard without a backup one on another live server, the least loaded first
    (by copies held, primaries and backups); its copy is not whole yet (``complete`` is cleared)."""
    done = []
    for k in sorted(routing):
        if k in backups:
            continue
        load = _load(routing, backups, live)
        candidates = sorted((load[p][1], p) for p in live if p != routing[k])
        if candidates:
            backups[k] = candidates[0][1]
            complete.pop(k, None)
            done.append(f"shard {k}: backup {backups[k]}")
    return done


def rebalance(num_shards: int, routing: MutableMapping[int, str], backups: MutableMapping[int, str],
              complete: MutableMapping[int, str], in_sync: Mapping[str, frozenset[tuple[int, str]]],
              live: list[str], replicas: int, placeable: Iterable[int] = (), moves: bool = True) -> list[str]:
    """Applies the rules of the module docstring; returns one line per change. ``moves``: False while
    a checkpoint is being cut (chief/checkpointer.py): free shards are still placed and backups
    refilled, but no primary moves and no backup is re-aimed."""
    live = sorted(set(live))
    if not live:
        return []
    done: list[str] = []
    for k in sorted(set(placeable)):
        if k not in routing and 0 <= k < num_shards:
            load = _load(routing, backups, live)
            p = min(live, key=lambda q: (load[q][0], load[q][1], q))
            routing[k] = p
            backups.pop(k, None)
            complete.pop(k, None)
            done.append(f"shard {k} -> {p} (placed)")
    if replicas < 2:
        return done
    done += assign_backups(routing, backups, complete, live)
    if not moves:
        return done
    cap = bound(num_shards, len(live))
    while True:
        moved = _move_one(cap, routing, backups, complete, in_sync, live)
        if not moved:
            break
        done.append(moved)
        done += assign_backups(routing, backups, complete, live)
    done += _aim_backups(cap, routing, backups, complete, live)
    return done


def _move_one(cap: int, routing: MutableMapping[int, str], backups: MutableMapping[int, str],
              complete: MutableMapping[int, str], in_sync: Mapping[str, frozenset[tuple[int, str]]],
              live: list[str]) -> str:
    """Hands one shard of the most overloaded primary to its whole backup with room; "" if none can move."""
    load = _load(routing, backups, live)
    mine: dict[str, list[int]] = {}
    for k, q in routing.items():
        mine.setdefault(q, []).append(k)
    for p in sorted(live, key=lambda q: (-load[q][0], q)):
        if load[p][0] <= cap:
            return ""
        options = []
        for k in sorted(mine.get(p, ())):
            b = backups.get(k)
            if b in load and load[b][0] < cap and complete.get(k) == b and (k, b) in in_sync.get(p, frozenset()):
                options.append((load[b], b, k))
        if options:
            _, b, k = min(options)
            routing[k] = b
            del backups[k]
            complete.pop(k, None)
            return f"shard {k}: moved from {p} to {b} (its whole backup; {p} held {load[p][0]} > {cap})"
    return ""


def _aim_backups(cap: int, routing: Mapping[int, str], backups: MutableMapping[int, str],
                 complete: MutableMapping[int, str], live: list[str]) -> list[str]:
    """For each overloaded primary, makes sure as many of its shards as it holds over the bound have
    their backup on a server with room (re-aiming the backups of others); those copies are made next."""
    done = []
    load = _load(routing, backups, live)
    for p in sorted(live):
        over = load[p][0] - cap
        if over <= 0:
            continue
        mine = sorted(k for k, q in routing.items() if q == p)
        aimed = [k for k in mine if backups.get(k) in load and load[backups[k]][0] < cap]
        # re-aim first the shards whose backup is not whole anyway (no whole copy is given up for them)
        rest = sorted((k for k in mine if k not in aimed), key=lambda k: (complete.get(k) == backups.get(k), k))
        for k in rest[:max(0, over - len(aimed))]:
            # the room left counts the primaries already on their way there (whole backups of overloaded shards)
            pending = {q: 0 for q in live}
            for j, q in routing.items():
                b = backups.get(j)
                if b in pending and load[q][0] > cap:
                    pending[b] += 1
            room = sorted((load[q][0] + pending[q], load[q][1], q) for q in live
                          if q != p and load[q][0] + pending[q] < cap)
            if not room:
                break
            new = room[0][2]
            old = backups.get(k)
            backups[k] = new
            complete.pop(k, None)
            load = _load(routing, backups, live)
            done.append(f"shard {k}: backup {new} (was {old or 'none'}), to take it over from {p}")
    return done
