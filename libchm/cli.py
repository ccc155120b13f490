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


# chm serve's malformed-command counters (CHM_OP_STATS_JSON), printed as one section; "bad_entries" is this
# tool's own (none).
BAD_ENTRY_KEYS = ("bad_entries", "device_bad_entries", "bad_entries_by_client", "clients_detached_bad",
                  "max_bad_entries")


def _fields(counts: dict) -> str:
    return ", ".join(f"{field} {n}" for field, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def _print_bad_entries(stats: dict) -> None:
    """Bad submission entries by field: device-wide (detached clients' included) and per attached client."""
    if "device_bad_entries" not in stats:  # a device from before they were counted
        return
    total = stats["device_bad_entries"]
    limit = stats.get("max_bad_entries", 0)
    print(f"  bad entries: {sum(total.values())} ({_fields(total)}); clients detached for them: "
          f"{stats.get('clients_detached_bad', 0)} (limit {limit or 'none'} per client)")
    for cid, counts in sorted(stats.get("bad_entries_by_client", {}).items(), key=lambda kv: int(kv[0])):
        print(f"    client {cid}: {sum(counts.values())} ({_fields(counts)})")


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
    _print_bad_entries(stats)
    for key, value in stats.items():
        if key in ("clients", "client_id") or key in BAD_ENTRY_KEYS:
            continue
        if isinstance(value, dict):
            value = json.dumps(value)
        print(f"  {key:<24} {value}")
    return 0
