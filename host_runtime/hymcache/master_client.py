"""The Master's client: its methods over ZeroMQ, with typed results."""

from __future__ import annotations

from typing import Union

from .messages import BlockLoc, DeviceInfo, WriteLoc, to
from .rpc import RpcClient, TypedClient


class MasterClient(TypedClient):
    """The Master's methods over ZeroMQ, with typed results. One thread at a time (like RpcClient)."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, curve_keys: str | None = None):
        self.rpc = RpcClient(endpoint, timeout_s, curve_keys=curve_keys)
        self.endpoint = endpoint

    def register_node(self, node: int, endpoint: str, devices: list[DeviceInfo]) -> bytes:
        """Registers the node; its lease secret."""
        return self.rpc.call("register_node", node, endpoint, list(devices))

    def nodes(self) -> dict:
        return {int(n): {"endpoint": e["endpoint"], "devices": to(list[DeviceInfo], e["devices"])}
                for n, e in self.rpc.call("nodes").items()}

    def lookup(self, keys: list[bytes], timeout_s: float | None = None,
               request_id: str | None = None) -> list[BlockLoc]:
        """``request_id``: the request the leases are for (BlockLoc.lease)."""
        args = (list(keys),) if request_id is None else (list(keys), request_id)
        return to(list[BlockLoc], self.rpc.call("lookup", *args, timeout_s=timeout_s))

    def put_start(self, request_id: str, keys: list[bytes], sizes: list[int]) -> list[WriteLoc | None]:
        return to(list[Union[WriteLoc, None]], self.rpc.call("put_start", request_id, list(keys), list(sizes)))

    def put_end(self, keys: list[bytes], checksums: list[int], versions: list[int] | None = None) -> int:
        return self.rpc.call("put_end", list(keys), list(checksums), None if versions is None else list(versions))

    def put_revoke(self, keys: list[bytes], versions: list[int] | None = None) -> int:
        return self.rpc.call("put_revoke", list(keys), None if versions is None else list(versions))

    def remove(self, keys: list[bytes]) -> int:
        return self.rpc.call("remove", list(keys))

    def stats(self) -> dict:
        return self.rpc.call("stats")

