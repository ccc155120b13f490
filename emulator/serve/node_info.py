"""``chm info --device NODE``: what a running device's node says (no attach)."""

from __future__ import annotations

import json

from common.units import format_bytes
from emulator.errors import ChmError

from driver.wire import NodeError, read_node


def print_device_info(node: str, as_json: bool = False) -> int:
    try:
        info = read_node(node)
    except NodeError as exc:
        raise ChmError(exc.errno, exc.strerror) from None
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("served by", f"pid {info['server_pid']}" + (" (pacing)" if info["pacing"] else "")),
        ("profile", info["profile"]),
        ("capacity", f"{format_bytes(info['capacity_bytes'])} on {info['ssd_count']} SSD(s)"),
        ("DRAM", f"{format_bytes(info['dram_bytes'])} in pages of {format_bytes(info['page_size'])}"),
        ("policy", info["policy"] + (f" (write buffer {format_bytes(info['write_buffer_bytes'])})"
                                     if info["write_buffer_bytes"] else "")),
        ("prefetch window", f"{format_bytes(info['prefetch_window_bytes'])}, {info['prefetch_max_handles']} handles"),
        ("clients", f"{info['clients']} attached, {info['clients_total']} since start"),
        ("data", "bytes move" if info["data"] else "off (state and time only)"),
    ]
    print(f"device: {info['node']}")
    for key, value in rows:
        print(f"  {key:<16} {value}")
    return 0
