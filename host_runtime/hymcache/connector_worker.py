"""The worker side of the HyMCache KV connector (vLLM's worker, beside the model): it moves the blocks
between the devices and the engine's paged KV.

``register_kv_caches``, ``bind_connector_metadata``, ``start_load_kv`` (loads every block of the step:
Manager ``acquire`` -> libchm ``submit_read`` of the block's pieces (whole layers, about 1 MiB) into the
handle's staging buffer -> as each lands, xxh3 of it and a copy into the engine's paged KV, while the device
moves the next -> ``release``, not waited for), ``wait_for_layer_load`` (nothing left to wait for: loads
finish in ``start_load_kv``, as LMCache's non-layerwise mode), ``save_kv_layer`` (copies each layer of the
blocks to store straight into the staging buffer of the device the Master chose), ``wait_for_save`` (device
writes; refused ones skipped; one ``put_end``), ``get_finished``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``, ``shutdown``.

Engine hooks a subclass overrides (vLLM: ``connector_vllm.py``): ``register_kv_caches`` (then
``_use_kv_caches``), ``_copy_into_kv`` / ``_copy_from_kv`` (one block's layers between the engine's KV and
the block bytes)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from driver.errors import ChmError

from .clock import Clock
from .connector_common import (FIGURES_KEPT, ConnectorSide, HyMCacheConfig, HyMCacheConnectorMetadata, LoadSpec,
                               SaveSpec, TurnFigures)
from .messages import BlockLoc, WriteLoc, to
from .step import layer_name

# A block is read in pieces of about this many bytes (whole layers), so the copy into the engine's KV of
# one piece runs while the device copies the next; big enough that a piece's command costs little.
READ_PIECE_BYTES = 1 << 20
MAX_READ_PIECES = 32  # in flight at once on one handle: half of libchm's default queue depth


@dataclass
class _Pending:
    """One request's store in the step that saves it."""

    request_id: str
    keys: list[bytes]
    locs: list[WriteLoc]
    block_ids: list[int]
    device: object = None         # local: the libchm handle whose staging buffer holds the blocks
    manager: object = None        # remote: the node's KV Manager that writes them
    buffer: memoryview | None = None
    slot0: int = 0                # first slot (in blocks) of this request in ``buffer``


class HyMCacheConnectorWorker(ConnectorSide):
    """The worker side; the arguments are ``ConnectorSide``'s. ``figures``: per request, what it did."""

    def __init__(self, config: HyMCacheConfig | dict | None, *, master=None, manager_for_node=None,
                 clock: Clock | None = None, log=None):
        super().__init__(config, master=master, manager_for_node=manager_for_node, clock=clock, log=log)
        self.figures: dict[str, TurnFigures] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.block_bytes = 0
        self._devices: dict[tuple[int, int], object] = {}
        self._meta: HyMCacheConnectorMetadata | None = None
        self._load_errors: set[int] = set()
        self._loaded_ok: dict[str, int] = {}     # request -> blocks loaded (the prefix kept)
        self._failed_now: set[str] = set()       # requests with a load error this step
        self._pending: list[_Pending] = []
        self._host_buffer = bytearray()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not isinstance(kv_caches, dict) or not kv_caches:
            raise ChmError(errno.EINVAL, "kv_caches must be a non-empty dict of layer name -> tensor")
        dtype = getattr(torch, self.config.kv_dtype)
        caches = list(kv_caches.values())
        shape = tuple(caches[0].shape)
        for name, kv in kv_caches.items():
            if kv.dtype != dtype or tuple(kv.shape) != shape or len(shape) != 5 or shape[1] != 2 \
                    or shape[2] != self.block_size or not kv.is_contiguous():
                raise ChmError(errno.EINVAL, f"kv_caches[{name!r}] is {kv.dtype} {tuple(kv.shape)}; allowed: "
                                             f"{dtype} [num_blocks, 2, chunk_size={self.block_size}, kv_heads, "
                                             f"head_dim], contiguous, the same for every layer")
        self._use_kv_caches(kv_caches, caches[0][0].numel() * caches[0].element_size())

    def _use_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_bytes: int) -> None:
        """Adopt checked KV tensors (one per layer, in layer order); ``layer_bytes``: one layer of one block."""
        caches = list(kv_caches.values())
        self.kv_caches = caches
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.layer_bytes = layer_bytes
        self.block_bytes = self.layer_bytes * len(caches)
        # byte views [num_blocks, bytes of a layer of an engine block] of each layer's KV, for the loads' copies
        self._kv_bytes = [kv.view(torch.uint8).numpy().reshape(kv.shape[0], -1) for kv in caches]
        per_piece = max(-(-READ_PIECE_BYTES // self.layer_bytes), -(-len(caches) // MAX_READ_PIECES))
        self._pieces = [(lo, min(lo + per_piece, len(caches))) for lo in range(0, len(caches), per_piece)]
        if self.block_bytes > self.config.staging_bytes:
            raise ChmError(errno.EINVAL, f"staging_buffer_size {self.config.staging_buffer_size} GB is outside the "
                                         f"allowed range: at least one block ({self.block_bytes} bytes)")

    def _device(self, node: int, device: int):
        """The libchm handle of a device of this machine (opened once; its epoch checked against the Master's)."""
        import libchm

        dev = self._devices.get((node, device))
        if dev is not None:
            return dev
        info = self._device_info(node, device) or self._device_info(node, device, refresh=True)
        if info is None:
            raise ChmError(errno.ENODEV, f"device {device} of node {node} is not registered with the Master")
        dev = libchm.Device(info.node_path, staging_bytes=self.config.staging_bytes)
        epoch = dev.info()["device_epoch"]
        if epoch != info.epoch:  # restarted since we last asked? the Master may know already
            info = self._device_info(node, device, refresh=True) or info
        if epoch != info.epoch:
            dev.close()
            raise ChmError(errno.ESTALE, f"device {info.node_path} has epoch {epoch}, the Master lists {info.epoch}: "
                                         "its blocks are from before a restart")
        self._devices[(node, device)] = dev
        return dev

    def _drop_device(self, node: int, device: int) -> None:
        dev = self._devices.pop((node, device), None)
        if dev is not None:
            dev.close()

    def bind_connector_metadata(self, connector_metadata: HyMCacheConnectorMetadata) -> None:
        if not isinstance(connector_metadata, HyMCacheConnectorMetadata):
            raise ChmError(errno.EINVAL, f"connector_metadata must be HyMCacheConnectorMetadata, not "
                                         f"{type(connector_metadata).__name__}")
        self._meta = connector_metadata

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Load every block of this step's loads, then reserve the stores of this step's saves."""
        if self._meta is None:
            raise ChmError(errno.EINVAL, "start_load_kv before bind_connector_metadata")
        self._failed_now = set()
        for rm in self._meta.requests:
            if rm.load is not None:
                self._load(rm.request_id, rm.load)
        self._pending = []
        for rm in self._meta.requests:
            if rm.save is not None and rm.request_id not in self._failed_now:
                self._reserve(rm.request_id, rm.save)

    def _load(self, rid: str, spec: LoadSpec) -> None:
        fig = self.figures.setdefault(rid, TurnFigures())
        deadline = self.clock.now() + self.config.blocking_timeout_secs
        self.counters["num_retrieve_requests"] += 1
        nodes, done, hinted = set(), 0, set()
        for i, (key, loc, block_id) in enumerate(zip(spec.keys, spec.locs, spec.block_ids)):
            nodes.add(loc.node)
            try:
                self._load_block(rid, key, loc, block_id, deadline, fig, hinted, spec.locs[i:])
            except ChmError as exc:
                fig.load_errors += 1
                self.counters["num_load_errors"] += 1
                if exc.errno == errno.ETIMEDOUT:
                    self.counters["num_timeouts_recompute"] += 1
                self.log(f"request {rid}: block {i} ({key.hex()}) failed to load: {exc}; recomputing from there")
                self._load_errors.update(spec.block_ids[i:])
                self._failed_now.add(rid)
                break
            done += 1
        self._loaded_ok[rid] = done
        fig.loaded_blocks += done
        self.counters["num_hit_tokens"] += done * self.block_size
        self._finish_on(rid, nodes)  # cancels what the Manager still stages for it

    def _load_block(self, rid: str, key: bytes, loc: BlockLoc, block_id: int, deadline: float, fig: TurnFigures,
                    hinted: set, rest: list[BlockLoc]) -> None:
        manager = self.manager_for_node(loc.node)
        remaining = deadline - self.clock.now()
        if remaining <= 0:
            raise ChmError(errno.ETIMEDOUT, f"blocking_timeout_secs {self.config.blocking_timeout_secs} passed")
        fetch = manager.read if self.config.transfer == "remote" else manager.acquire
        try:
            token, data = self._unpack(fetch(rid, key, remaining))
        except ChmError as exc:
            if exc.errno != errno.ENOENT or loc.node in hinted:
                raise
            hinted.add(loc.node)  # the Lookup's hint went elsewhere or was cancelled: hint the rest ourselves
            manager.hint(rid, [r.key for r in rest])
            leased = [r for r in rest if r.lease and r.node == loc.node]
            if leased and callable(getattr(manager, "lease", None)):
                manager.lease(rid, leased)  # the Lookup's leases: a served Manager's read asks for them
            token, data = self._unpack(fetch(rid, key, max(deadline - self.clock.now(), 0.0)))
        try:
            if token.length != self.block_bytes:
                raise ChmError(errno.EPROTO, f"stored block is {token.length} bytes; this engine's blocks are "
                                             f"{self.block_bytes}")
            checksum_of = xxhash.xxh3_64() if self.config.verify_checksum else None
            if data is not None:  # remote: the block came in a ZeroMQ frame; into our transfer space
                if len(data) != self.block_bytes:
                    raise ChmError(errno.EPROTO, f"the Manager sent {len(data)} bytes for a block of {token.length}")
                staging = self._host_staging(self.block_bytes)[:self.block_bytes]
                staging[:] = data
                if checksum_of is not None:
                    checksum_of.update(staging)
                self._copy_into_kv(block_id, 0, len(self.kv_caches), staging)
            else:
                try:
                    dev = self._device(token.node, token.device)
                    device_ns = self._read_in_pieces(dev, token, block_id, checksum_of)
                except ChmError:
                    self._drop_device(token.node, token.device)  # gone or restarted: reopen next time
                    raise
                fig.device_time_ns += device_ns
                self.counters["device_time_ns"] += device_ns
            # Checked once the whole block is in: a block that fails is a load error, and the engine
            # recomputes it (and what follows), overwriting what was copied.
            if checksum_of is not None and checksum_of.intdigest() != token.checksum:
                self._remove(key)
                raise ChmError(errno.EBADMSG, f"block at offset {token.offset} of device {token.device} fails its "
                                              "xxh3 checksum")
            fig.loaded_bytes += self.block_bytes
            self.counters["loaded_bytes"] += self.block_bytes
        finally:
            try:
                manager.release_later(rid, key)  # its outcome is not needed: off the load's critical path
            except ChmError as exc:
                self.log(f"release of block {key.hex()} of request {rid}: {exc}")

    def _read_in_pieces(self, dev, token, block_id: int, checksum_of) -> int:
        """Device -> staging buffer -> engine KV, pipelined: the device copies piece i + 1 into the staging
        buffer while this thread copies piece i into the KV (and hashes it). Pieces are whole layers.
        The modelled device time of the block (its pieces, served back to back), in ns."""
        staging = dev.buffer()[:self.block_bytes]
        in_flight = device_ns = 0
        try:
            for i, (lo, hi) in enumerate(self._pieces):
                dev.submit_read(token.offset + lo * self.layer_bytes,
                                staging[lo * self.layer_bytes:hi * self.layer_bytes], user_data=i)
                in_flight += 1
            for lo, hi in self._pieces:
                ((_, moved, latency_ns),) = dev.reap(1, 1)
                in_flight -= 1
                if moved < 0:
                    raise ChmError(-moved, f"read of layers {lo}..{hi - 1} of the block at offset {token.offset} "
                                           f"of device {token.device}: {os.strerror(-moved)}")
                device_ns += latency_ns
                piece = staging[lo * self.layer_bytes:hi * self.layer_bytes]
                if checksum_of is not None:
                    checksum_of.update(piece)
                self._copy_into_kv(block_id, lo, hi, piece)
        finally:
            while in_flight:  # never leave the handle with commands in flight (its sync calls would get EBUSY)
                try:
                    in_flight -= len(dev.reap(in_flight, in_flight))
                except ChmError:
                    break  # the device went away: our caller drops the handle
        return device_ns

    def _copy_into_kv(self, block_id: int, lo: int, hi: int, src) -> None:
        """Layers ``lo..hi - 1`` of one block (``src``: their bytes in the block layout) into the engine's KV.
        One thread (numpy's memcpy): torch's parallel copy waits for a core that the device or the Manager
        holds, and a copy this size gains nothing from a second thread."""
        for layer in range(lo, hi):
            self._kv_bytes[layer][block_id] = np.frombuffer(src, np.uint8, self.layer_bytes,
                                                            (layer - lo) * self.layer_bytes)

    @staticmethod
    def _unpack(result) -> tuple:
        """(token, bytes or None) from acquire (a token), KVManager.read (a Payload) or ManagerClient.read (a pair)."""
        from .rpc import Payload

        if isinstance(result, Payload):
            return result.result, result.frames[0]
        if isinstance(result, tuple):
            return result
        return result, None

    def _host_staging(self, nbytes: int) -> memoryview:
        """Host transfer space for the remote path (grown on demand, never past staging_buffer_size)."""
        if len(self._host_buffer) < nbytes:
            self._host_buffer = bytearray(nbytes)
        return memoryview(self._host_buffer)

    def _remove(self, key: bytes) -> None:
        try:
            self.master.remove([key])
        except ChmError as exc:
            self.log(f"remove of corrupt block {key.hex()}: {exc}")

    def _reserve(self, rid: str, spec: SaveSpec) -> None:
        """put_start for the blocks this request did not load; staging slots for the ones the Master places."""
        skip = self._loaded_ok.get(rid, 0)
        keys, block_ids = spec.keys[skip:], spec.block_ids[skip:]
        if not keys:
            return
        fig = self.figures.setdefault(rid, TurnFigures())
        self.counters["num_store_requests"] += 1
        try:
            locs = self.master.put_start(rid, keys, [self.block_bytes] * len(keys))
        except ChmError as exc:
            self.counters["num_store_errors"] += 1
            self.counters["num_skipped_stores"] += len(keys)
            fig.skipped_stores += len(keys)
            self.log(f"put_start of request {rid}: {exc}; its blocks are offered again next turn")
            return
        chosen = [(k, to(WriteLoc, loc) if not isinstance(loc, WriteLoc) else loc, b)
                  for k, loc, b in zip(keys, locs, block_ids) if loc is not None]
        if not chosen:
            return
        p = _Pending(rid, [c[0] for c in chosen], [c[1] for c in chosen], [c[2] for c in chosen])
        loc0 = p.locs[0]
        try:
            if self.config.transfer == "remote":
                p.manager = self.manager_for_node(loc0.node)
            else:
                p.device = self._device(loc0.node, loc0.device)
        except ChmError as exc:
            self._skip(p, p.keys, fig, exc)
            return
        if p.device is not None:
            used = sum(len(q.keys) for q in self._pending if q.device is p.device)
        else:
            used = sum(len(q.keys) for q in self._pending if q.device is None)
        room = self.config.staging_bytes // self.block_bytes - used
        if any((loc.node, loc.device) != (loc0.node, loc0.device) or loc.length != self.block_bytes
               for loc in p.locs) or room <= 0:
            self._skip(p, p.keys, fig, ChmError(errno.ENOSPC, "blocks spread over devices, of another size, or no "
                                                              "room left in the staging buffer"))
            return
        if room < len(p.keys):  # transfer space, not a cache: what does not fit is offered again next turn
            self._skip(p, p.keys[room:], fig, ChmError(errno.ENOSPC, "staging buffer full"))
            p.keys, p.locs, p.block_ids = p.keys[:room], p.locs[:room], p.block_ids[:room]
        p.slot0 = used
        if p.device is not None:
            p.buffer = p.device.buffer()
        else:  # remote: this step's blocks share one host buffer, sized for all of them
            self._host_staging((used + len(p.keys)) * self.block_bytes)
        self._pending.append(p)

    def _skip(self, p: _Pending, keys: list[bytes], fig: TurnFigures, exc: ChmError) -> None:
        self.counters["num_skipped_stores"] += len(keys)
        fig.skipped_stores += len(keys)
        self.log(f"request {p.request_id}: {len(keys)} blocks not stored ({exc}); offered again next turn")
        version_of = {loc.key: loc.version for loc in p.locs}
        try:
            self.master.put_revoke(list(keys), [version_of[k] for k in keys])  # only our own put_starts
        except ChmError as rexc:
            self.log(f"put_revoke of request {p.request_id}: {rexc}")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in start_load_kv (the whole block is needed to check its checksum)."""
        self._layer(layer_name)

    def _layer(self, name: str) -> int:
        i = self.layer_index.get(name)
        if i is None:
            raise ChmError(errno.EINVAL, f"layer_name {name!r} is not a registered KV cache layer "
                                         f"(e.g. {layer_name(0)!r} .. {layer_name(len(self.kv_caches) - 1)!r})")
        return i

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        """Copy this layer of every block to store into its slot of the device's staging buffer."""
        layer = self._layer(layer_name)
        for p in self._pending:
            staging = p.buffer if p.buffer is not None else memoryview(self._host_buffer)
            for j, block_id in enumerate(p.block_ids):
                start = (p.slot0 + j) * self.block_bytes + layer * self.layer_bytes
                self._copy_from_kv(kv_layer, block_id, staging[start:start + self.layer_bytes])

    def _copy_from_kv(self, kv_layer: torch.Tensor, block_id, dst: memoryview) -> None:
        """One layer of one engine block (``kv_layer``: that layer's KV tensor) into ``dst``, its bytes."""
        torch.frombuffer(dst, dtype=kv_layer.dtype).copy_(kv_layer[block_id].reshape(-1))

    def wait_for_save(self) -> None:
        """Write the staged blocks; a refused write is skipped (never retried, never waited on); one put_end."""
        for p in self._pending:
            fig = self.figures.setdefault(p.request_id, TurnFigures())
            staging = p.buffer if p.buffer is not None else memoryview(self._host_buffer)
            written, sums, versions, skipped = [], [], [], []
            for j, (key, loc) in enumerate(zip(p.keys, p.locs)):
                data = staging[(p.slot0 + j) * self.block_bytes:(p.slot0 + j + 1) * self.block_bytes]
                fig.write_attempts += 1
                try:
                    checksum = xxhash.xxh3_64_intdigest(data)
                    if p.device is not None:
                        p.device.write(loc.offset, data)
                    else:
                        self._write_remote(p.manager, loc, data)
                except ChmError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.ENOSPC):
                        self.counters["num_store_errors"] += 1
                        self.log(f"write of block {key.hex()} of request {p.request_id}: {exc}")
                    skipped.append(key)
                    continue
                if p.device is not None:
                    fig.device_time_ns += p.device.last_latency_ns
                    self.counters["device_time_ns"] += p.device.last_latency_ns
                written.append(key)
                sums.append(checksum)
                versions.append(loc.version)
            if skipped:
                self._skip(p, skipped, fig, ChmError(errno.EAGAIN, "the device refused the writes"))
            if written:
                try:
                    self.master.put_end(written, sums, versions)  # only our own put_starts, if one timed out
                except ChmError as exc:
                    self.counters["num_store_errors"] += 1
                    self.log(f"put_end of request {p.request_id}: {exc} (its put_starts will be revoked)")
                    continue
                fig.stored_blocks += len(written)
                self.counters["num_stored_tokens"] += len(written) * self.block_size
                self.counters["stored_bytes"] += len(written) * self.block_bytes
        self._pending = []

    @staticmethod
    def _write_remote(manager, loc: WriteLoc, data) -> None:
        """Through the node's KV Manager: a ManagerClient sends the block as one zero-copy frame."""
        from .manager import ManagerClient

        if isinstance(manager, ManagerClient):
            manager.write(loc.device, loc.offset, data)
        else:
            manager.write(loc.device, loc.offset, payload=[data])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is asynchronous: no request is ever still saving or loading after its step."""
        for rid in finished_req_ids or ():
            self._loaded_ok.pop(rid, None)
        while len(self.figures) > FIGURES_KEPT:  # a long-running worker keeps only the recent requests' figures
            del self.figures[next(iter(self.figures))]
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose load failed since the last call (the engine recomputes from the first)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def shutdown(self) -> None:
        for dev in self._devices.values():
            dev.close()
        self._devices = {}
        super().shutdown()
