"""The media directory's metadata: ``MEDIA_DIR/chm.meta``, a sidecar of the
SSD backing files (whose byte layout it leaves alone).

Layout (little-endian, ``META_LAYOUT``, 64 bytes):

====== ====== =========================================================
offset  bytes  field
====== ====== =========================================================
0       8      magic ``b"CHMMEDIA"``
8       4      format version (``META_VERSION``)
12      4      clean-shutdown flag: 1 after a clean close, 0 while open
16      8      device epoch: random 64-bit id drawn when the media are formatted
24      8      ssd.count
32      8      ssd.capacity_bytes
40      8      ssd.stripe_bytes
48      8      device.page_size_bytes
56      4      reserved, 0
60      4      CRC-32 of bytes [0, 60)
====== ====== =========================================================

It is always replaced atomically: written to a temporary file, fsync'd,
renamed over the old one, and the directory fsync'd.
"""

from __future__ import annotations

import errno
import os
import secrets
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from common.fs import fsync_dir

from .config import Config
from .errors import ChmError

META_NAME = "chm.meta"
META_MAGIC = b"CHMMEDIA"
META_VERSION = 1
META_LAYOUT = struct.Struct("<8sIIQQQQQI")  # everything before the checksum
META_CRC = struct.Struct("<I")
META_SIZE = META_LAYOUT.size + META_CRC.size
FORMAT_HINT = "pass --format (Device.open(..., format_media=True)) to erase the media and start empty"


def media_file(media_dir: Path, index: int) -> Path:
    return media_dir / f"ssd{index}.img"


def geometry_of(cfg: Config) -> dict[str, int]:
    """The fields the media's layout depends on; a profile must match them to read the media."""
    return {"ssd.count": cfg.ssd.count, "ssd.capacity_bytes": cfg.ssd.capacity_bytes,
            "ssd.stripe_bytes": cfg.ssd.stripe_bytes, "device.page_size_bytes": cfg.device.page_size_bytes}


@dataclass(frozen=True)
class MediaMeta:
    epoch: int
    geometry: dict
    clean: bool

    def pack(self) -> bytes:
        g = self.geometry
        head = META_LAYOUT.pack(META_MAGIC, META_VERSION, int(self.clean), self.epoch, g["ssd.count"],
                                g["ssd.capacity_bytes"], g["ssd.stripe_bytes"], g["device.page_size_bytes"], 0)
        return head + META_CRC.pack(zlib.crc32(head))

    @classmethod
    def unpack(cls, raw: bytes, path: Path) -> "MediaMeta":
        def bad(what: str) -> ChmError:
            return ChmError(errno.EINVAL, f"media metadata {str(path)!r} {what}: not media of this device; {FORMAT_HINT}")

        if len(raw) != META_SIZE:
            raise bad(f"is {len(raw)} bytes, expected {META_SIZE}")
        head = raw[:META_LAYOUT.size]
        magic, version, clean, epoch, count, capacity, stripe, page, _ = META_LAYOUT.unpack(head)
        if magic != META_MAGIC:
            raise bad(f"has magic {magic!r}, expected {META_MAGIC!r}")
        if META_CRC.unpack(raw[META_LAYOUT.size:])[0] != zlib.crc32(head):
            raise bad("fails its checksum (damaged)")
        if version != META_VERSION:
            raise bad(f"has format version {version}; this device reads version {META_VERSION}")
        return cls(epoch, {"ssd.count": count, "ssd.capacity_bytes": capacity, "ssd.stripe_bytes": stripe,
                           "device.page_size_bytes": page}, bool(clean))


def write_meta(media_dir: Path, meta: MediaMeta) -> None:
    """Replace ``chm.meta`` atomically and durably."""
    path = media_dir / META_NAME
    tmp = media_dir / f".{META_NAME}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, meta.pack())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        fsync_dir(media_dir)
    except OSError as exc:
        raise ChmError(exc.errno or errno.EIO, f"cannot write media metadata {str(path)!r}: {exc.strerror}") from None


def _read_meta(path: Path) -> MediaMeta:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ChmError(exc.errno or errno.EIO, f"cannot read media metadata {str(path)!r}: {exc.strerror}") from None
    return MediaMeta.unpack(raw, path)


def _existing_media_files(media_dir: Path) -> list[Path]:
    return sorted(media_dir.glob("ssd*.img"))


def _create_media_file(path: Path, capacity: int) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        raise ChmError(exc.errno or errno.EIO, f"cannot create media file {str(path)!r}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, capacity)  # sparse: blocks are allocated only when written
        os.fsync(fd)
    except OSError as exc:
        raise ChmError(exc.errno or errno.EIO, f"cannot size media file {str(path)!r} to ssd.capacity_bytes = "
                       f"{capacity}: {exc.strerror} (beyond what this file system allows?)") from None
    finally:
        os.close(fd)


def format_media(cfg: Config, media_dir: Path) -> MediaMeta:
    """Erase the media: every backing file recreated empty at its capacity (sparse), a new epoch."""
    meta_path = media_dir / META_NAME
    for old in [meta_path, *_existing_media_files(media_dir)]:  # metadata first: half-erased media are never "valid"
        old.unlink(missing_ok=True)
    try:
        for i in range(cfg.ssd.count):
            _create_media_file(media_file(media_dir, i), cfg.ssd.capacity_bytes)
    except BaseException:  # leave an empty directory behind, not half-formatted media
        for made in _existing_media_files(media_dir):
            made.unlink(missing_ok=True)
        raise
    meta = MediaMeta(secrets.randbits(64), geometry_of(cfg), clean=True)
    write_meta(media_dir, meta)
    return meta


def check_media(cfg: Config, media_dir: Path) -> MediaMeta:
    """The media's metadata, after checking it and every backing file against ``cfg``; refuses foreign,
    missing or truncated media with an error naming the file and what is wrong."""
    meta_path = media_dir / META_NAME
    if not meta_path.exists():
        files = _existing_media_files(media_dir)
        raise ChmError(errno.EINVAL, f"media file {str(files[0])!r} exists but the media metadata {str(meta_path)!r} "
                                     f"is missing: these media were not made by this device; {FORMAT_HINT}")
    meta = _read_meta(meta_path)
    want = geometry_of(cfg)
    for key, value in want.items():
        if meta.geometry[key] != value:
            raise ChmError(errno.EINVAL, f"media in {str(media_dir)!r} were formatted with {key} = {meta.geometry[key]}, "
                                         f"the profile {cfg.source} has {key} = {value}: wrong profile for these "
                                         f"media? or {FORMAT_HINT}")
    for i in range(cfg.ssd.count):
        path = media_file(media_dir, i)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ChmError(errno.ENOENT, f"media file {str(path)!r} is missing (the metadata {str(meta_path)!r} "
                                         f"says there are {cfg.ssd.count}): data lost; {FORMAT_HINT}") from None
        if size != cfg.ssd.capacity_bytes:
            raise ChmError(errno.EINVAL, f"media file {str(path)!r} is {size} bytes, expected ssd.capacity_bytes = "
                                         f"{cfg.ssd.capacity_bytes} (truncated?): data lost; {FORMAT_HINT}")
    return meta


def open_media(cfg: Config, media_dir: Path, format_requested: bool) -> tuple[MediaMeta, bool]:
    """Check (or format) the media and mark them open (clean flag cleared, durably).

    Returns (metadata as now on disk, whether the previous shutdown was unclean). A directory
    with neither metadata nor backing files is formatted: there is nothing to lose."""
    fresh = not (media_dir / META_NAME).exists() and not _existing_media_files(media_dir)
    if format_requested or fresh:
        meta = format_media(cfg, media_dir)
    else:
        meta = check_media(cfg, media_dir)
    unclean = not meta.clean
    meta = replace(meta, clean=False)
    write_meta(media_dir, meta)
    return meta, unclean


def mark_clean(media_dir: Path, meta: MediaMeta) -> None:
    """At a clean close, after everything written is synced."""
    write_meta(media_dir, replace(meta, clean=True))
