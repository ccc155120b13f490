"""``chm hymcache simulate``: HyMCache serving at paper scale, in virtual time, on this machine.

Usage::

    chm hymcache simulate --figure 13                     # the paper's Fig. 13 preset, all its tiers
    chm hymcache simulate --figure 13 --tiers hymcache,lmcache-local --dram 128GiB --json out.json --plot out.png
    chm hymcache simulate --preset my.toml --conversations 64 --turns 4
    chm hymcache simulate --figure 10                     # PD 4P-1D-1S (Qwen2.5-32B, ~1.5 TB reusable KV)
    chm hymcache simulate --figure 12                     # Fig. 10 with staging 10-40 GB per node (a sweep)
    chm hymcache simulate --figure 15                     # one node, the device prefetch on and off
    chm hymcache simulate --workload mooncake --trace-limit 2000   # the shared Mooncake trace, open loop
    chm hymcache sweep --figure 13 --sweep tier=hymcache,lmcache-local --sweep dram=32GiB,64GiB --out sw

Every setting of a preset (``presets/figNN.toml``, each number with its source) has a flag; see
``chm hymcache simulate --help``.

How it is built:

* ``events.py``: one heap of events in virtual time (ns); processes are generators.
* ``workload.py``: LMSYS-style multi-turn chat (the replayer's conversation statistics; prompts over a
  length for Fig. 15), AIPerf-style synthetic multi-turn conversations (ISL, answers threaded into the
  history, a shared prefix, routed to a prefill worker per conversation) and Mooncake JSONL traces (the
  replayer's reader; hash blocks as keys, each request at its timestamp, rows per window of arrivals).
* ``worker.py``: a vLLM-like worker (chunked prefill, prefix cache, the KV connector's synchronous
  loads and stores), the PD decode worker (admits by KV room, pulls the prompt's KV over the P->D
  links, decodes; the prefill worker frees its blocks once pulled) and the clients
  (``workload.client``: ``turn-barrier``, turn by turn with ``concurrency`` in flight; ``per-session``,
  AIPerf's multi-turn mode: ``concurrency`` sessions, each sends its next turn once the previous is answered;
  ``open_client``: a trace, open loop).
* ``gpu.py``: step time from FLOPs and bytes on a GPU profile (``replay/prefill.py`` + ``gpus/``);
  ``gpucache.py``: vLLM's prefix cache (LRU of free blocks, tail first).
* ``tiers/``: the remote tiers, one per module, behind one interface (``RemoteTier``): recompute, gpu-prefix,
  lmcache-local, mooncake-dram (Mooncake Store's master over one DRAM segment per prefill node, transfer
  buffers with insert timeouts), hymcache (the runtime's ``Master`` and ``KVManager`` in process on a
  ``ManualClock`` the simulation drives, over the emulator's ``Controller`` with data off),
  hymcache-noprefetch (the same without the Manager's window: demand reads), cmm-h.
  Links are the emulator's timing pipes (the device's RDMA link inside its Controller; PCIe here).
* ``run.py``: the topologies (single node; PD: prefill nodes with a KV port and a P->D port each, a
  decode node, the storage node's link as the device's), one run per tier (per tier x staging size with
  a sweep), rows per tier x turn, summaries, speedups (makespan ratios);
  ``report.py``: table and plot; ``cli.py``: the subcommand.
* ``sweep.py``: ``chm hymcache sweep``, a grid of ``simulate_tier`` runs (tiers x DRAM x staging x workloads,
  or any setting), one Dask task per point through ``replay/sweep.py``'s plumbing (``run_tasks``).

Adding a tier means one more ``RemoteTier`` class (per node, over a shared backend in PD).
"""
