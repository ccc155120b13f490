"""``chm hymcache chat``: the SmolLM2 multi-turn demo through the KV connector, on the real vLLM; and the same
demo in process on ``engine.PagedEngine`` (``in_process_chat``: no vLLM, what the connector's tests run)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from common.cli import UsageError
from common.units import format_bytes
from driver.errors import ChmError

from ..prompts import FOLLOW_UPS, OPENINGS, next_turn_prompt
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


# ---- the SmolLM2 multi-turn demo in process, on PagedEngine ---------------------------------
def in_process_chat(master=None, turns: int = 4, conversations: int = 3, *, curve_keys: str | None = None,
                    model=None, tokenizer=None, max_tokens: int = 8, config=None, manager_for_node=None,
                    num_blocks: int = 256, log=None) -> list[dict]:
    """Multi-turn SmolLM2 conversations through the connector on ``PagedEngine``; a row per turn.

    ``master``: a running set's Master endpoint (tcp://...), or a Master object (in process, with
    ``manager_for_node``); ``config``: a HyMCacheConfig or its dict. Each turn runs twice: through the
    connector, and on the reference engine (connector off, a full recomputation); ``identical`` says the
    greedy tokens are the same. Rows: conversation, turn (from 1), prefix_tokens (the turn's prompt:
    everything before its answer), reused_tokens (loaded from the devices), recomputed_tokens (prefilled
    here), loaded_bytes, skipped_stores, identical, device_ms (modelled device time of the turn's loads and
    stores) and ttft_ms (wall time to the first token)."""
    from ..connector import connector_pair
    from ..connector_common import CHECK, HyMCacheConfig, TurnFigures
    from ..engine import PagedEngine  # the test fixture engine: only this in-process chat runs it

    for name, value, high in (("turns", turns, 1000), ("conversations", conversations, 1000),
                              ("max_tokens", max_tokens, 4096)):
        CHECK.int(name, value, 1, high)
    if master is None:
        raise ChmError(errno.EINVAL, "master None: give a running set's Master endpoint or a Master object")
    if model is None:
        from host_runtime.hybridgen.model import SmolLM2

        model = SmolLM2.load()
    if tokenizer is None:
        from host_runtime.hybridgen.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(model.tokenizer_reader)
    values = config.as_dict() if isinstance(config, HyMCacheConfig) else dict(config or {})
    if isinstance(master, str):
        values.setdefault("master_endpoint", master)
        values.setdefault("curve_keys", curve_keys)
        master = None
    values.setdefault("staging_buffer_size", 0.25)  # the demo's blocks are small: 250 MB of transfer space
    cfg = HyMCacheConfig.from_dict(values)
    pair = connector_pair(cfg, master=master, manager_for_node=manager_for_node, log=log)
    engine = PagedEngine(model, chunk_size=cfg.chunk_size, num_blocks=num_blocks, connector=pair)
    reference = PagedEngine(model, chunk_size=cfg.chunk_size, num_blocks=num_blocks)
    run_tag = f"chat-{os.getpid()}-{time.monotonic_ns()}"  # request ids unique across runs against one set
    rows = []
    try:
        for c in range(conversations):
            prompt = tokenizer.encode(tokenizer.chat_prompt(OPENINGS[c % len(OPENINGS)]))
            for t in range(1, turns + 1):
                rid = f"{run_tag}-c{c}-t{t}"
                got = engine.generate(rid, prompt, max_tokens, tokenizer.eos_id)
                ref = reference.generate(rid + "-ref", prompt, max_tokens, tokenizer.eos_id)
                fig = pair[1].figures.pop(rid, TurnFigures())
                rows.append({"conversation": c + 1, "turn": t, "prefix_tokens": len(prompt),
                             "reused_tokens": got.reused_tokens, "recomputed_tokens": got.recomputed_tokens,
                             "loaded_bytes": fig.loaded_bytes, "skipped_stores": fig.skipped_stores,
                             "identical": got.output_token_ids == ref.output_token_ids,
                             "device_ms": fig.device_time_ns / 1e6,
                             "ttft_ms": (got.first_token_time - got.arrival) * 1e3,
                             "load_errors": fig.load_errors, "stored_blocks": fig.stored_blocks})
                engine.release(rid)
                reference.release(rid + "-ref")
                prompt = next_turn_prompt(prompt, got.output_token_ids, FOLLOW_UPS[(c + t - 1) % len(FOLLOW_UPS)],
                                          tokenizer)
    finally:
        engine.shutdown()
    return rows
