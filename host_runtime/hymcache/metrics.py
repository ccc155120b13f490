"""HyMCache counters in Prometheus text format (``prometheus-client``).

The Master and each KV Manager answer ``stats()`` with a flat dict of counters
(plus per-device figures). This module gives those counters the names vLLM and
LMCache users know (``lmcache:num_lookup_requests`` becomes
``hymcache:num_lookup_requests``; prometheus-client adds ``_total`` to a
counter in the text format) and serves them over HTTP (``--metrics-port``):

    hymcache:num_lookup_requests_total{component="master"}     lookup calls
    hymcache:num_lookup_tokens_total                            keys (blocks) asked for
    hymcache:num_lookup_hits_total                              blocks found (stored prefix)
    hymcache:num_retrieve_requests_total                        blocks handed to workers (Manager)
    hymcache:num_hit_tokens_total                               ... and their tokens / blocks
    hymcache:num_store_requests_total                           put_start calls
    hymcache:num_stored_tokens_total                            blocks registered (put_end)
    hymcache:num_skipped_stores_total                           stores given up (revoked, refused)
    hymcache:num_load_errors_total                              blocks that failed to load
    hymcache:num_timeouts_recompute_total                       requests past their timeout
    hymcache:num_evictions_total                                blocks evicted (watermarks)
    hymcache:prefetch_window_bytes                              bytes staged in prefetch windows now
    hymcache:device_used_bytes{node=,device=}                   bytes stored per device

A counter the component has but this table does not name is still exported
(``hymcache:<component>_<key>``, untyped), so nothing a stats() dict says is
lost; ``chm hymcache stats`` prints the same dicts (``rows``).

Threads: a component is served by one thread (its ``RpcServer``), and its
state is not locked. A scrape therefore does not call ``stats()`` from the
HTTP thread: it asks the serving thread (``StatsExporter.tick``, run by the
server's tick) for a fresh snapshot and waits for it a bounded time, falling
back to the last one.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, UntypedMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "hymcache:"


@dataclass(frozen=True)
class Metric:
    name: str               # without PREFIX; counters without _total (prometheus-client adds it)
    kind: str               # "counter" | "gauge"
    help: str
    keys: tuple[str, ...]   # the stats() keys it is read from (first present wins)


METRICS: tuple[Metric, ...] = (
    Metric("num_lookup_requests", "counter", "Lookup calls (batches of keys) answered",
           ("num_lookup_requests", "lookup_requests", "lookups")),
    Metric("num_lookup_tokens", "counter", "Keys (blocks) asked for in lookups",
           ("num_lookup_tokens", "lookup_tokens", "lookup_keys", "lookup_blocks")),
    Metric("num_lookup_hits", "counter", "Keys (blocks) found stored by lookups (the contiguous prefix)",
           ("num_lookup_hits", "lookup_hits", "lookup_hit_blocks")),
    Metric("num_retrieve_requests", "counter", "Blocks requested for retrieval (hinted, acquired or read)",
           ("num_retrieve_requests", "retrieve_requests", "hints", "hint_requests")),
    Metric("num_hit_tokens", "counter", "Blocks handed to workers staged (retrieve hits)",
           ("num_hit_tokens", "retrieve_hit_tokens", "hit_tokens", "retrieve_hits", "acquired", "staged_blocks")),
    Metric("num_store_requests", "counter", "Store requests (put_start calls)",
           ("num_store_requests", "store_requests", "put_requests", "put_starts", "put_start_requests")),
    Metric("num_stored_tokens", "counter", "Blocks registered by put_end (visible to lookups)",
           ("num_stored_tokens", "stored_tokens", "registered_blocks", "stored_blocks", "put_end_blocks")),
    Metric("num_skipped_stores", "counter", "Blocks whose store was given up (revoked put_starts, refused writes)",
           ("num_skipped_stores", "skipped_stores", "revoked_blocks", "revoked", "put_revoked")),
    Metric("num_load_errors", "counter", "Blocks that failed to load (device gone, timeout, checksum mismatch)",
           ("num_load_errors", "load_errors")),
    Metric("num_timeouts_recompute", "counter", "Requests whose blocks were not ready in time (recomputed)",
           ("num_timeouts_recompute", "timeouts_recompute", "timeouts", "request_timeouts")),
    Metric("num_evictions", "counter", "Blocks evicted past the high watermark (LRU, complete and unleased)",
           ("num_evictions", "evictions", "evicted")),
    Metric("prefetch_window_bytes", "gauge", "Bytes staged or in flight in the requests' prefetch windows now",
           ("prefetch_window_bytes", "window_bytes_in_use", "staged_bytes")),
    Metric("num_blocks", "gauge", "Complete blocks stored", ("num_blocks", "blocks", "entries", "complete_blocks")),
    Metric("used_bytes", "gauge", "Bytes of stored and in-flight blocks", ("used_bytes", "bytes_used", "stored_bytes")),
)

# Per-device figures: a stats() key holding one dict per device ({"node": n, "device": d, "used_bytes": ...}),
# as a list or as a dict keyed by the device's name; its numeric fields become labelled gauges.
DEVICE_KEYS = ("devices", "per_device", "device_bytes")
_LABEL_FIELDS = ("node", "device", "node_path", "endpoint")
_NAME_OK = re.compile(r"[^a-zA-Z0-9_:]")


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _clean(name: str) -> str:
    return _NAME_OK.sub("_", name)


def _device_rows(value) -> list[dict]:
    if isinstance(value, dict):
        rows = []
        for name, row in value.items():
            if isinstance(row, dict):
                rows.append({"device": str(name), **row} if "device" not in row else dict(row))
            elif _number(row) is not None:
                rows.append({"device": str(name), "used_bytes": row})
        return rows
    if isinstance(value, list):
        return [dict(row) for row in value if isinstance(row, dict)]
    return []


def families(component: str, stats: dict, labels: dict[str, str] | None = None) -> list:
    """The Prometheus metric families of one ``stats()`` dict (of ``component``: master, manager)."""
    base = {"component": component, **(labels or {})}
    names, values = list(base), list(base.values())
    out, used = [], set()
    for m in METRICS:
        for key in m.keys:
            value = _number(stats.get(key))
            if value is not None:
                cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                fam = cls(PREFIX + m.name, m.help, labels=names)
                fam.add_metric(values, value)
                out.append(fam)
                used.add(key)
                break
    for key in DEVICE_KEYS:
        rows = _device_rows(stats.get(key))
        if not rows:
            continue
        used.add(key)
        fields: dict[str, GaugeMetricFamily] = {}
        for row in rows:
            row_labels = {f: str(row[f]) for f in _LABEL_FIELDS if f in row}
            lnames = names + [f for f in _LABEL_FIELDS if f in row_labels]
            lvalues = values + [row_labels[f] for f in _LABEL_FIELDS if f in row_labels]
            for field, v in row.items():
                num = _number(v)
                if field in _LABEL_FIELDS or num is None:
                    continue
                name = PREFIX + "device_" + _clean(field if not field.startswith("device_") else field[7:])
                fam = fields.get((name, tuple(lnames)))
                if fam is None:
                    fam = fields[(name, tuple(lnames))] = GaugeMetricFamily(
                        name, f"Per device: {field}", labels=lnames)
                fam.add_metric(lvalues, num)
        out.extend(fields.values())
    for key, value in sorted(stats.items()):
        num = _number(value)
        if key in used or num is None:
            continue
        fam = UntypedMetricFamily(PREFIX + _clean(f"{component}_{key}"), f"{component} stats() {key}", labels=names)
        fam.add_metric(values, num)
        out.append(fam)
    return out


class _Collector(Collector):
    def __init__(self, exporter: "StatsExporter"):
        self.exporter = exporter

    def collect(self) -> Iterator:
        yield from families(self.exporter.component, self.exporter.snapshot(), self.exporter.labels)


class StatsExporter:
    """Serve ``stats_fn()`` of one component as Prometheus text on ``http://host:port/metrics``.

    ``port`` 0 picks a free port (see ``.port``). With ``threaded=True`` (a component served by an
    ``RpcServer``) ``stats_fn`` runs only inside ``tick()``, which the serving thread calls; a scrape
    waits up to ``wait_s`` for it. Without, a scrape calls ``stats_fn`` itself.
    """

    def __init__(self, component: str, stats_fn: Callable[[], dict], *, port: int = 0, host: str = "127.0.0.1",
                 labels: dict[str, str] | None = None, threaded: bool = True, wait_s: float = 2.0):
        self.component, self.stats_fn, self.labels = component, stats_fn, dict(labels or {})
        self.threaded, self.wait_s = threaded, wait_s
        self._cond = threading.Condition()
        self._want = False
        self._generation = 0
        self._snapshot: dict = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def tick(self) -> None:
        """In the serving thread: refresh the snapshot if a scrape asked for one."""
        if not self._want:  # unlocked read: a missed request is seen at the next tick
            return
        snap = self.stats_fn()
        with self._cond:
            self._snapshot, self._want = snap, False
            self._generation += 1
            self._cond.notify_all()

    def snapshot(self) -> dict:
        if not self.threaded:
            return self.stats_fn()
        with self._cond:
            generation = self._generation
            self._want = True
            self._cond.wait_for(lambda: self._generation != generation, timeout=self.wait_s)
            return self._snapshot

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def chain_tick(server, exporter: StatsExporter | None) -> None:
    """Make ``server`` (an RpcServer) also run ``exporter.tick`` at each of its ticks."""
    if exporter is None:
        return
    before = server.tick

    def tick() -> None:
        if before is not None:
            before()
        exporter.tick()

    server.tick = tick


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value} (tests, and anyone scraping by hand)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def rows(stats: dict) -> Iterable[tuple[str, str]]:
    """(name, value) lines of one stats() dict for ``chm hymcache stats``: known counters by their
    metric names first, then the rest as the component named them."""
    used = set()
    for m in METRICS:
        for key in m.keys:
            if _number(stats.get(key)) is not None:
                used.add(key)
                yield m.name, _fmt(stats[key])
                break
    for key in DEVICE_KEYS:
        if isinstance(stats.get(key), (list, dict)):
            used.add(key)
        for row in _device_rows(stats.get(key)):
            where = " ".join(f"{f}={row[f]}" for f in _LABEL_FIELDS if f in row)
            body = " ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k not in _LABEL_FIELDS)
            yield f"device {where}", body
    for key, value in stats.items():
        if key not in used:
            yield key, _fmt(value)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
