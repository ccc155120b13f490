"""``chm hymcache simulate``: HyMCache serving at paper scale, in virtual time, on this machine.

Usage::

    chm hymcache simulate --figure 13                     # the paper's Fig. 13 preset, all its tiers
    chm hymcache simulate --figure 13 --tiers hymcache,lmcache-local --dram 128GiB --json out.json --plot out.png
    chm hymcache simulate --preset my.toml --conversations 64 --turns 4

Every setting of a preset (``presets/figNN.toml``, each number with its source) has a flag; see
``chm hymcache simulate --help``.

How it is built:

* ``events.py``: one heap of events in virtual time (ns); processes are generators.
* ``workload.py``: LMSYS-style multi-turn chat (the replayer's conversation statistics).
* ``worker.py``: a vLLM-like worker (chunked prefill, prefix cache, the KV connector's synchronous
  loads and stores) and the client (turn by turn, ``concurrency`` in flight).
* ``gpu.py``: step time from FLOPs and bytes on a GPU profile (``replay/prefill.py`` + ``gpus/``);
  ``gpucache.py``: vLLM's prefix cache (LRU of free blocks, tail first).
* ``tiers.py``: the remote tiers behind one interface (``RemoteTier``): recompute, gpu-prefix,
  lmcache-local, hymcache (the runtime's ``Master`` and ``KVManager`` in process on a
  ``ManualClock`` the simulation drives, over the emulator's ``Controller`` with data off), cmm-h.
  Links are the emulator's timing pipes (the device's RDMA link inside its Controller; PCIe here).
* ``run.py``: one run per tier, rows per tier x turn, summaries, speedups (makespan ratios);
  ``report.py``: table and plot; ``cli.py``: the subcommand.

Adding a topology (the PD setups of Fig. 10-12, 14, 15) means more workers and hosts sharing one
tier; adding a tier means one more ``RemoteTier`` class.
"""
