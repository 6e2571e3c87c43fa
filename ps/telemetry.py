"""A parameter server's Prometheus metrics, read from its :class:`~shoal.ps.host.ShardHost` when scraped.

Nothing on the push path updates them: a scrape reads each held copy's version,
size and push counts, and the host's byte counters (RPC latency and errors come
from the interceptor every server has, :mod:`shoal.observe.metrics`).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from shoal.observe import metrics


def collector(host):
    """The collect function for ``metrics.register_state``: one family per figure, labelled by shard and role."""

    def collect():
        copies = [(k, s, host.roles.get(k, "?")) for k, s in sorted(dict(host.shards).items())]
        yield metrics.gauge("shoal_shard_version", "Updates applied to each shard copy this server holds",
                            ["shard", "role"], [([str(k), r], s.version) for k, s, r in copies])
        yield metrics.gauge("shoal_shard_bytes", "Bytes of each shard copy's fp32 weights",
                            ["shard", "role"], [([str(k), r], 4 * s.numel) for k, s, r in copies])
        tables = [(k, r, t) for k, s, r in copies for t in s.table_status()]
        yield metrics.gauge("shoal_table_rows", "Rows of an embedding table's partition a shard copy holds",
                            ["table", "shard", "role"], [([t["name"], str(k), r], t["rows"]) for k, r, t in tables])
        yield metrics.gauge("shoal_table_bytes", "Bytes of an embedding table's partition (rows and their optimizer "
                            "state) a shard copy holds", ["table", "shard", "role"],
                            [([t["name"], str(k), r], t["bytes"]) for k, r, t in tables])
        yield metrics.gauge("shoal_table_bytes_per_row", "Bytes a row of an embedding table costs on a server "
                            "(values, optimizer state, id and counters)", ["table"],
                            [([n], v) for n, v in sorted({t["name"]: t["bytes_per_row"] for _, _, t in tables}.items())])
        applied = CounterMetricFamily("shoal_shard_pushes_applied", "Pushes a shard copy applied",
                                      labels=["shard", "role"])
        dropped = CounterMetricFamily("shoal_shard_pushes_dropped", "Pushes a shard copy dropped (late in a "
                                      "sync round, refused)", labels=["shard", "role"])
        for k, s, r in copies:
            applied.add_metric([str(k), r], s.stats.pushes_applied)
            dropped.add_metric([str(k), r], s.stats.pushes_dropped)
        yield applied
        yield dropped
        refused = CounterMetricFamily("shoal_shard_updates_refused", "Updates the update guard refused, clipped "
                                      "or rolled back (ps/guard.py), per worker", labels=["shard", "role", "worker"])
        rolled = CounterMetricFamily("shoal_shard_steps_rolled_back", "Steps rolled back: they would have left "
                                     "a weight or optimizer state NaN/Inf", labels=["shard", "role"])
        for k, s, r in copies:
            for w, n in sorted(s.guard_counts().items()):
                refused.add_metric([str(k), r, w], n)
            rolled.add_metric([str(k), r], s.guard.refusals.rolled_back)
        yield refused
        yield rolled
        received = CounterMetricFamily("shoal_ps_received_bytes", "Bytes of pushes this server received")
        received.add_metric([], host.bytes_in)
        yield received
        sent = CounterMetricFamily("shoal_ps_sent_bytes", "Bytes of pulls this server sent")
        sent.add_metric([], host.bytes_out)
        yield sent

    return collect
