"""The KV Manager: one per storage node, in front of the node's `chm serve` devices.

It takes prefetch hints (a request's keys in the order the worker will consume them), resolves
them against the Master itself (batches of 32, in order: the paper's remote-hit matching in the
Manager) and stages the blocks stored on this node with ``chm_prefetch_object`` in that order,
at most a window of blocks per request at once: min(``window_bytes`` worth of blocks, the
hits), never fewer than 2 (double buffering). A device that answers EBUSY (its prefetch window or
handles are full) leaves the block queued; it is issued again at the next progress (a release, a
hint, the server's tick), never failed. A worker gets a ``ReadToken`` per staged block
(``acquire``), reads it (libchm directly on the same machine, ``read`` over ZeroMQ from another
one) and gives it back (``release``), which moves the window on. Served, the Manager never waits on a
device: an acquire (or read) whose block is still staging is held by the server, which polls the device
(``chm_prefetch_poll``) and answers once the block is staged, so one request's staging delays no other call.

A hint may carry the descriptors of the Lookup's own Master lookup: those blocks start staging at once,
and the Manager's lookup stays the authority (only blocks it confirms are handed out). Served over
ZeroMQ, such a hint is answered as soon as staging starts and confirmed right after (the server's tick)
or at the request's first block call, whichever comes first, so the Lookup waits for one Master round
trip, not two.

A request's prefetches are cancelled (handles released) on ``finish``, when nothing touched it
for ``request_timeout_s`` on the injected clock, and when its worker disconnects: the served
Manager watches its ROUTER socket's monitor for DISCONNECTED events and maps each caller's ZeroMQ
routing id to the socket fd its messages came in on (``zmq.SRCFD``). A request remembers every
connection that used it (the worker's Lookup hints on one, its reads come on another) and is
cancelled when the last of them closes. A worker whose process dies has its TCP/IPC connections
closed by the kernel, so its requests go at once; the timeout is the backstop for a worker that
hangs with a connection open.

A device that goes away (ENODEV: its ``chm serve`` died) loses its libchm handle and the blocks staged
through it (they fail: the worker recomputes). The Manager reopens it at its next use and on the
server's tick (at most every ``REOPEN_INTERVAL_S`` per device; the tick also notices a device restarted
under an idle Manager: its node shows another server pid or node file). Back with another epoch (``--format``), its
old blocks are stale: the node is registered with the Master again, which drops them.

State is guarded by one lock: the served Manager (its RpcServer thread) and in-process callers
(other threads) may share one KVManager. libchm handles are one thread's at a time, which the lock
also guarantees.

The pieces, by role: manager_core.py (KVManager; its hint and block paths in manager_hints.py and
manager_blocks.py, the state they share and the argument checks in manager_state.py), confirmer.py (the
background confirmation), manager_server.py (the RPC adapter, ManagerServer, serve_manager, the roles),
manager_client.py (ManagerClient) and manager_service.py (start_manager: the one start-up path, which
``chm hymcache manager`` and run_manager take). This module re-exports what others import.
"""

from __future__ import annotations

from host_runtime.hymcache.confirmer import _Confirmer  # noqa: F401
from host_runtime.hymcache.manager_client import FIRST_POLL_S, ManagerClient  # noqa: F401
from host_runtime.hymcache.manager_core import KVManager  # noqa: F401
from host_runtime.hymcache.manager_server import (HOLD_MAX_S, MANAGER_METHODS, MANAGER_ROLES,  # noqa: F401
                                                  MAX_HELD, ManagerServer, serve_manager)
from host_runtime.hymcache.manager_service import (ManagerOptions, RunningManager, manager_options,  # noqa: F401
                                                   run_manager, start_manager)
from host_runtime.hymcache.manager_state import (LOOK_STEP_S, LOOKUP_BATCH, MAX_HINT_KEYS,  # noqa: F401
                                                 REOPEN_INTERVAL_S, REQUEST_TIMEOUT_S, WAIT_STEP_S,
                                                 _check_key, _check_keys, _check_request_id, _check_seconds,
                                                 node_path)
