"""``chm hymcache stats``: the Master's and every Manager's counters."""

from __future__ import annotations

import errno
import json
import os

from driver.errors import ChmError

from .common import _need


def _stats(args) -> int:
    from ..metrics import rows

    MasterClient, = _need("master", ("MasterClient",))
    ManagerClient, = _need("manager", ("ManagerClient",))
    keys = args.curve_keys
    if keys and not os.path.isdir(keys):
        raise ChmError(errno.ENOENT, f"--curve-keys {keys}: no such directory")
    if keys and args.key:
        from ..auth import key_file

        keys = key_file(keys, args.key)
    master = MasterClient(args.master, timeout_s=args.timeout, curve_keys=keys)
    try:
        mstats = master.stats()
        nodes = master.nodes()
    finally:
        master.close()
    managers, failed = {}, []
    for node, desc in sorted(nodes.items(), key=lambda kv: int(kv[0])):
        endpoint = desc["endpoint"] if isinstance(desc, dict) else desc.endpoint
        client = ManagerClient(endpoint, timeout_s=args.timeout, curve_keys=keys)
        try:
            managers[str(node)] = {"endpoint": endpoint, **client.stats()}
        except ChmError as exc:
            managers[str(node)] = {"endpoint": endpoint, "error": str(exc)}
            failed.append(f"manager of node {node}: {exc}")
        finally:
            client.close()
    if args.json:
        print(json.dumps({"master": mstats, "managers": managers}, indent=2, default=str))
    else:
        print(f"master {args.master}")
        for name, value in rows(mstats):
            print(f"  {name:<28} {value}")
        for node, st in managers.items():
            print(f"manager of node {node} at {st['endpoint']}")
            for name, value in rows({k: v for k, v in st.items() if k != "endpoint"}):
                print(f"  {name:<28} {value}")
    if failed:
        raise ChmError(errno.EHOSTUNREACH, "; ".join(failed))
    return 0
