"""The HyMCache Master: global metadata of every stored KV block.

The roles live beside this module, Mooncake's master_service / rpc_service / master_client split:

* ``master_table.py``: the 64-byte rows (layout in its docstring), their index, leases, versions, time base;
* ``allocator.py``: placement, each device's append-only space, expiry, watermarks, eviction choice;
* ``master_recovery.py`` and ``journal.py``: crash safety (journal, snapshot, recovery);
* ``master_core.py``: ``Master``, the coordinator of the calls;
* ``master_service.py``: the served Master (``serve_master``, roles, ``MasterOptions``, ``start_master``: the one
  start-up path ``chm hymcache master`` and tests take, ``run_master``);
* ``master_client.py``: ``MasterClient``.

This module is their facade: it re-exports every name others import from the Master.
"""

from .checks import (MAX_BATCH, MAX_DEVICE, MAX_LENGTH, MAX_NODE, MAX_TIMEOUT_S, PLACEMENTS,  # noqa: F401
                     _check_keys, _check_per_key, _check_request_id, _check_versions, check, check_registration,
                     set_options)
from .master_client import MasterClient  # noqa: F401
from .master_core import Master  # noqa: F401
from .master_service import (MASTER_METHODS, MASTER_ROLES, MasterOptions, RunningMaster,  # noqa: F401
                             master_options, run_master, serve_master, start_master)
from .master_table import _INITIAL_ROWS, COMPLETE, DRAINING, ENTRY_DTYPE, FREE, PENDING, MasterTable  # noqa: F401
