"""Prometheus export of the HyMCache counters: scraped over HTTP on 127.0.0.1 and parsed.

In process (an RpcServer serving a target from its own thread, as the Master and Managers are served)
and as processes (``chm hymcache master --metrics-port``).
"""

import os
import threading
import urllib.request

import pytest

from host_runtime.hymcache.metrics import METRICS, PREFIX, StatsExporter, chain_tick, families, parse, rows
from host_runtime.hymcache.rpc import RpcClient, RpcServer

from .procs import free_port, master_proc, random_keys, stop_proc, store_raw


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


def value(samples: dict, name: str, **labels) -> float:
    found = [v for (n, ls), v in samples.items()
             if n == name and all(dict(ls).get(k) == str(w) for k, w in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples in {sorted(n for n, _ in samples)}"
    return found[0]


class Counting:
    """Stands in for a component: its state is touched by the serving thread only."""

    def __init__(self):
        self.counts = {"lookup_requests": 0, "lookup_tokens": 0, "lookup_hits": 0, "evictions": 0,
                       "prefetch_window_bytes": 0, "a_new_counter": 0,
                       "devices": [{"node": 0, "device": 0, "used_bytes": 0, "capacity_bytes": 1 << 30},
                                   {"node": 0, "device": 1, "used_bytes": 0, "capacity_bytes": 1 << 30}]}
        self.thread_of_stats = set()

    def lookup(self, n, hits):
        self.counts["lookup_requests"] += 1
        self.counts["lookup_tokens"] += n
        self.counts["lookup_hits"] += hits
        self.counts["devices"][1]["used_bytes"] += 4096 * hits
        return hits

    def stats(self):
        self.thread_of_stats.add(threading.get_ident())
        return {k: (list(map(dict, v)) if isinstance(v, list) else v) for k, v in self.counts.items()}


def test_names_are_the_lmcache_ones_and_every_counter_is_exported():
    names = {m.name for m in METRICS}
    for n in ("num_lookup_requests", "num_lookup_tokens", "num_lookup_hits", "num_retrieve_requests",
              "num_hit_tokens", "num_store_requests", "num_stored_tokens", "num_skipped_stores", "num_load_errors",
              "num_timeouts_recompute", "num_evictions", "prefetch_window_bytes"):
        assert n in names
    fams = {f.name: f for f in families("master", {"lookup_requests": 3, "evictions": 1, "odd": 7,
                                                   "devices": {"d0": {"node": 0, "used_bytes": 5}}})}
    assert fams[PREFIX + "num_lookup_requests"].type == "counter"
    assert fams[PREFIX + "num_lookup_requests"].samples[0].value == 3
    assert fams[PREFIX + "num_evictions"].samples[0].value == 1
    assert fams[PREFIX + "master_odd"].samples[0].value == 7          # unknown keys are not dropped
    dev = fams[PREFIX + "device_used_bytes"].samples[0]
    assert dev.labels == {"component": "master", "node": "0", "device": "d0"} and dev.value == 5
    printed = dict(rows({"lookup_requests": 3, "odd": 7}))
    assert printed == {"num_lookup_requests": "3", "odd": "7"}


def test_scrape_over_http_sees_counts_from_the_serving_thread():
    target = Counting()
    server = RpcServer(target, ["lookup", "stats"], "tcp://127.0.0.1:0", tick_s=0.02)
    exporter = StatsExporter("master", target.stats, port=0, host="127.0.0.1")
    chain_tick(server, exporter)
    t = threading.Thread(target=server.serve_forever)
    t.start()
    try:
        with RpcClient(server.endpoint, 5.0) as c:
            for hits in (0, 2, 5):
                c.call("lookup", 32, hits)
        s = scrape(exporter.url)
        assert value(s, "hymcache:num_lookup_requests_total", component="master") == 3
        assert value(s, "hymcache:num_lookup_tokens_total") == 96
        assert value(s, "hymcache:num_lookup_hits_total") == 7
        assert value(s, "hymcache:num_evictions_total") == 0
        assert value(s, "hymcache:device_used_bytes", node=0, device=1) == 7 * 4096
        assert value(s, "hymcache:device_used_bytes", node=0, device=0) == 0
        assert value(s, "hymcache:device_capacity_bytes", device=0) == 1 << 30
        assert value(s, "hymcache:master_a_new_counter") == 0
        # stats() ran in the serving thread, never in the HTTP one
        assert target.thread_of_stats == {t.ident}
    finally:
        server.stop()
        t.join(10)
        exporter.close()
    with pytest.raises(OSError):  # closed: the port no longer answers
        urllib.request.urlopen(exporter.url, timeout=2)


def test_master_process_exports_its_counters(tmp_path):
    port = free_port()
    proc, info = master_proc(tmp_path, "--metrics-port", str(port))
    try:
        from host_runtime.hymcache.master import MasterClient

        assert info["metrics_port"] == port
        before = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(before, "hymcache:num_lookup_requests_total", component="master") == 0
        mc = MasterClient(info["endpoint"], timeout_s=10)
        try:
            keys = random_keys(5)
            mc.lookup(keys)                       # nothing stored: 5 asked, 0 hits
            mc.lookup(keys[:2])
            after = scrape(f"http://127.0.0.1:{port}/metrics")
            assert value(after, "hymcache:num_lookup_requests_total") == 2
            assert value(after, "hymcache:num_lookup_tokens_total") == 7
            assert value(after, "hymcache:num_lookup_hits_total") == 0
        finally:
            mc.close()
    finally:
        stop_proc(proc)


def test_manager_process_exports_its_counters_and_per_device_bytes(tmp_path):
    from host_runtime.hymcache.cli import HyMCacheSet

    port = free_port()
    with HyMCacheSet(1, 2, metrics_port=port, tag=f"hymcache-metrics-{os.getpid()}") as hset:
        desc = hset.describe()
        mport = desc["managers"][0]["metrics_port"]
        assert mport == port + 1
        stored = [loc for loc, _ in store_raw(desc["master"], 3, 64 << 10)]
        master = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(master, "hymcache:num_stored_tokens_total", component="master") == len(stored)
        used = sum(v for (n, ls), v in master.items() if n == "hymcache:device_used_bytes")
        assert used == sum(loc.length for loc in stored)
        mgr = scrape(f"http://127.0.0.1:{mport}/metrics")
        assert value(mgr, "hymcache:prefetch_window_bytes", component="manager", node=0) == 0
        assert value(mgr, "hymcache:num_load_errors_total", component="manager") == 0
        from host_runtime.hymcache.manager import ManagerClient

        with ManagerClient(desc["managers"][0]["endpoint"], timeout_s=10) as man:
            assert man.hint("scraped", [loc.key for loc in stored]) == len(stored)
            mgr = scrape(f"http://127.0.0.1:{mport}/metrics")
            # the hinted blocks sit in the request's window (staged or in flight), on their device
            assert value(mgr, "hymcache:prefetch_window_bytes", component="manager") == sum(l.length for l in stored)
            dev = stored[0].device
            assert value(mgr, "hymcache:device_staged_bytes", device=dev) == sum(l.length for l in stored)
            man.finish("scraped")
            mgr = scrape(f"http://127.0.0.1:{mport}/metrics")
            assert value(mgr, "hymcache:prefetch_window_bytes", component="manager") == 0
