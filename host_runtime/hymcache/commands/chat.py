"""``chm hymcache chat``: the SmolLM2 multi-turn demo through the KV connector, on the real vLLM."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from common.cli import UsageError
from common.units import format_bytes
from driver.errors import ChmError

from .common import _curve
from .up import HyMCacheSet

CHAT_FIELDS = ("conversation", "turn", "prefix_tokens", "reused_tokens", "recomputed_tokens", "loaded_bytes",
               "skipped_stores", "identical")


def _chat(args) -> int:
    from ..hf_model import ensure_hf_folder
    from ..vllm_serve import VllmServer, chat, connector_config, kv_bytes_per_token

    hset = None
    master = args.master
    if args.curve_keys and master is not None and not os.path.isdir(args.curve_keys):
        raise ChmError(errno.ENOENT, f"--curve-keys {args.curve_keys}: no such directory (copy the set's keys here)")
    if args.reference and not args.vllm:
        raise UsageError("--reference goes with --vllm (the server with the connector it is compared with)")

    def stop(signum, frame):  # SIGTERM as Ctrl-C: what it started stops in order
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    keys = args.curve_keys
    workdir = tempfile.mkdtemp(prefix="chm-hymcache-chat-", dir="/var/tmp")
    servers: list = []
    try:
        model = ensure_hf_folder()
        if args.vllm:
            servers = [VllmServer(url=args.vllm)] + ([VllmServer(url=args.reference)] if args.reference else [])
        else:
            if master is None:
                keys = args.curve_keys = args.curve_keys or os.path.join(workdir, "keys")  # keys and roles too
                _curve(args, args.nodes)  # created here, before the children read them
                hset = HyMCacheSet(args.nodes, args.devices_per_node, profile=args.profile, curve_keys=keys,
                                   state_dir=os.path.join(workdir, "state"), label="chm hymcache chat",
                                   verbose=False)
                print(f"chm hymcache chat: starting a set ({args.nodes} node(s) x {args.devices_per_node} "
                      f"device(s))", file=sys.stderr, flush=True)
                hset.start()
                master = hset.master_endpoint
            print("chm hymcache chat: starting vllm serve with HyMCache, and a reference without a connector "
                  "(about a minute)", file=sys.stderr, flush=True)
            servers = [VllmServer(model, prefix_caching=args.prefix_caching,
                                  kv_transfer=connector_config(master, keys, args.key),
                                  log=Path(workdir) / "vllm-hymcache.log"),
                       VllmServer(model, prefix_caching=False, log=Path(workdir) / "vllm-reference.log")]
        for server in servers:
            server.wait_ready()
        rows = chat(servers[0], servers[1] if len(servers) > 1 else None, args.turns, args.conversations, max_tokens=args.max_tokens,
                    bytes_per_token=kv_bytes_per_token(model))
    finally:
        for server in servers:
            server.stop()
        if hset is not None:
            hset.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return 0 if all(r["identical"] is not False for r in rows) else 1
    cols = [("conv", "conversation", 4), ("turn", "turn", 4), ("prefix", "prefix_tokens", 7),
            ("vLLM hit", "vllm_cached_tokens", 8), ("HyMCache", "reused_tokens", 8),
            ("recomputed", "recomputed_tokens", 10), ("loaded", "loaded_bytes", 10), ("TTFT ms", "ttft_ms", 8),
            ("identical", "identical", 9)]
    print("  ".join(f"{h:>{w}}" for h, _, w in cols))
    for r in rows:
        cells = []
        for _, key, w in cols:
            v = r[key]
            if key == "loaded_bytes":
                v = format_bytes(v)
            elif v is None:
                v = "-"
            elif isinstance(v, float):
                v = f"{v:.1f}"
            cells.append(f"{v!s:>{w}}")
        print("  ".join(cells))
    if not all(r["identical"] is not False for r in rows):
        raise ChmError(errno.EIO, "greedy tokens differ from vLLM without the connector in some turn (see 'identical')")
    return 0
