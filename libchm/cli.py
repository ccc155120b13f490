"""``chm stats NODE``: live counters of a running device, read through libchm
(the tool attaches as one more client, like nvme-cli opening a controller)."""

from __future__ import annotations

import json


def register_stats(sub) -> None:
    p = sub.add_parser("stats", help="live counters of a running device (chm serve)",
                       description="Attach to a running device through libchm and print its counters: "
                                   "capacity, policy, clients attached and every controller counter.")
    p.add_argument("node", nargs="?", default=None,
                   help="device node name or path (default: $CHM_DEVICE, else chm0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_stats)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _stats(args) -> int:
    from . import Device

    with Device(args.node) as dev:  # an error (no device: ENODEV) is reported by chm's run()
        info, stats = dev.info(), dev.stats()
    others = stats["clients"] - 1  # this tool is one of them
    if args.json:
        print(json.dumps({"info": info, "clients_other_than_this_tool": others, "stats": stats}, indent=2))
        return 0
    print(f"device {args.node or 'chm0'} (pid {info['server_pid']}): {info['profile']}")
    print(f"  capacity {_mib(info['capacity_bytes'])}, DRAM {_mib(info['dram_bytes'])}, "
          f"page {_mib(info['page_size'])}, {info['ssd_count']} SSD(s), policy {info['policy']}")
    print(f"  clients attached: {others} (besides this tool)")
    for key, value in stats.items():
        if key in ("clients", "client_id"):
            continue
        if isinstance(value, dict):
            value = json.dumps(value)
        print(f"  {key:<24} {value}")
    return 0
