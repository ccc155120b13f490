"""Who may call what on the HyMCache network: keys, roles, ZAP, and the Master's read leases.

A key directory (CurveZMQ's "stonehouse" pattern) holds::

    server.key, server.key_secret   the servers' key pair (the Master and every KV Manager)
    authorized/NAME.key             the allow-list: each client's public key and its role(s)
    NAME.key, NAME.key_secret       a client's pair, made here; hand NAME.key_secret and server.key to it
    lease.secret                    the Master's lease secret (node secrets derive from it)

Every secret file is 0600 (the directory 0700), and a service refuses one readable by group or others.
A server answers only clients whose public key is in ``authorized/`` (ZAP: ``zmq.auth``'s authenticator,
reloaded when the directory changes), and each call only if the key's role allows its method
(``MASTER_ROLES`` in master.py, ``MANAGER_ROLES`` in manager.py): else ``EACCES`` naming the role.

A read lease is a capability: ``lease_token`` is the expiry (Unix ms) and an HMAC-SHA256 over (request id,
key, version, node, expiry) under the node's secret, which the Master derives from its lease secret and hands
to the node's Manager at ``register_node`` (a node's call). The Manager sends a block's bytes (``read``) only
to a request holding an unexpired token for that block's version. Expiry is wall time (``time.time``): the
Master's and the Managers' processes compare it, so machines need synchronized clocks (skew shifts leases).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import re
import socket
import stat
import sys
import threading
import time
from typing import NamedTuple

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from driver.errors import ChmError

ROLES = ("worker", "node", "admin", "monitor")
SERVER = "server"               # the servers' key pair
DEFAULT_CLIENT = "client"       # the operator's key make_keys creates (worker and admin)
AUTHORIZED = "authorized"       # the allow-list directory
LEASE_SECRET = "lease.secret"
SECRET_BYTES = 32
MAC_BYTES = 32
LEASE_BYTES = 8 + MAC_BYTES     # expiry (u8, Unix ms) + HMAC-SHA256
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Identity(NamedTuple):
    """An authenticated client: its key's name, roles, and (a node key) the node it may register."""

    name: str
    roles: frozenset
    node: int | None = None

    def user_id(self) -> str:
        """As ZAP hands it to the server per message (the frame property User-Id)."""
        return f"{self.name}|{','.join(sorted(self.roles))}|{'' if self.node is None else self.node}"

    @classmethod
    def from_user_id(cls, text: str) -> "Identity":
        name, roles, node = text.split("|")
        return cls(name, frozenset(r for r in roles.split(",") if r), int(node) if node else None)


# ------------------------------------------------------------------------------------------ files

def check_private(path: str) -> None:
    """A secret file must be the owner's alone: EACCES if group or others may read or write it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ChmError(errno.ENOENT, f"secret file {path}: not found (chm hymcache keys add makes one)") from None
    if mode & 0o077:
        raise ChmError(errno.EACCES, f"secret file {path} is mode {stat.S_IMODE(mode):04o}: readable by group or "
                                     f"others; refusing it (chmod 600 {path})")


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start: never readable
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _cert_text(public: bytes, secret: bytes | None, metadata: dict) -> str:
    """The zmq.auth certificate format (zmq.auth.load_certificate reads it)."""
    kind = "Secret" if secret else "Public"
    lines = [f"#   ZeroMQ CURVE **{kind}** Certificate (chm hymcache keys)", ""]
    if metadata:
        lines.append("metadata")
        lines += [f'    {k} = "{v}"' for k, v in metadata.items()]
    lines += ["curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _metadata(path: str) -> dict:
    out, section = {}, None
    with open(path) as f:
        for line in f:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if not line[0].isspace():
                section = line.strip()
            elif section == "metadata" and "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip().strip("'\"")
    return out


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name == SERVER:
        raise ChmError(errno.EINVAL, f"key name {name!r} must match {NAME_RE.pattern} and not be {SERVER!r}")
    return name


def check_roles(roles) -> frozenset:
    roles = frozenset(roles.split(",") if isinstance(roles, str) else roles)
    bad = sorted(r for r in roles if r not in ROLES)
    if not roles or bad:
        raise ChmError(errno.EINVAL, f"role {','.join(bad) or '(none)'} is not one of {', '.join(ROLES)}")
    return roles


def _key_dir(key_dir: str) -> str:
    os.makedirs(os.path.join(key_dir, AUTHORIZED), mode=0o700, exist_ok=True)
    os.chmod(key_dir, 0o700)
    return key_dir


def add_key(key_dir: str, name: str, roles, node: int | None = None) -> str:
    """Make client key ``name`` with ``roles`` (a node key: for ``node``) and authorize it; its secret file."""
    name, roles = check_name(name), check_roles(roles)
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 0):
        raise ChmError(errno.EINVAL, f"node {node!r} must be an integer >= 0")
    _key_dir(key_dir)
    secret_path = os.path.join(key_dir, f"{name}.key_secret")
    if os.path.exists(secret_path) or os.path.exists(os.path.join(key_dir, AUTHORIZED, f"{name}.key")):
        raise ChmError(errno.EEXIST, f"key {name!r} exists in {key_dir} already")
    public, secret = zmq.curve_keypair()
    meta = {"role": ",".join(sorted(roles)), **({} if node is None else {"node": str(node)})}
    _write_private(secret_path, _cert_text(public, secret, meta))
    with open(os.path.join(key_dir, f"{name}.key"), "w") as f:
        f.write(_cert_text(public, None, meta))
    with open(os.path.join(key_dir, AUTHORIZED, f"{name}.key"), "w") as f:  # last: the allow-list
        f.write(_cert_text(public, None, meta))
    return secret_path


def make_keys(key_dir: str, nodes: int = 0) -> None:
    """The servers' pair, the lease secret, the operator's ``client`` key (worker and admin) and ``node-N`` keys
    for nodes 0..nodes-1, each made only if missing."""
    _key_dir(key_dir)
    server_secret = os.path.join(key_dir, f"{SERVER}.key_secret")
    if not os.path.exists(server_secret):
        public, secret = zmq.curve_keypair()
        _write_private(server_secret, _cert_text(public, secret, {}))
        with open(os.path.join(key_dir, f"{SERVER}.key"), "w") as f:
            f.write(_cert_text(public, None, {}))
    path = os.path.join(key_dir, LEASE_SECRET)
    if not os.path.exists(path):
        _write_private(path, os.urandom(SECRET_BYTES).hex() + "\n")
    wanted = [(DEFAULT_CLIENT, ("worker", "admin"), None)] + [(f"node-{n}", ("node",), n) for n in range(nodes)]
    for name, roles, node in wanted:
        if not os.path.exists(os.path.join(key_dir, f"{name}.key_secret")):
            add_key(key_dir, name, roles, node)


def list_keys(key_dir: str) -> list[dict]:
    """The allow-list: name, roles, node of each authorized key."""
    out = []
    for ident in sorted(load_allowed(key_dir).values()):
        out.append({"name": ident.name, "roles": sorted(ident.roles), "node": ident.node})
    return out


def load_allowed(key_dir: str) -> dict[bytes, Identity]:
    """z85 public key -> Identity, from ``key_dir/authorized/*.key``."""
    folder = os.path.join(key_dir, AUTHORIZED)
    table = {}
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if not entry.endswith(".key"):
            continue
        path = os.path.join(folder, entry)
        try:
            public, _ = zmq.auth.load_certificate(path)
            meta = _metadata(path)
            roles = frozenset(r for r in meta.get("role", "").split(",") if r in ROLES)
            node = int(meta["node"]) if meta.get("node", "").isdigit() else None
        except (OSError, ValueError):
            continue  # unreadable: not authorized
        table[public] = Identity(entry[:-len(".key")], roles, node)
    return table


def load_lease_secret(key_dir: str) -> bytes:
    path = os.path.join(key_dir, LEASE_SECRET)
    check_private(path)
    with open(path) as f:
        text = f.read().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ChmError(errno.EINVAL, f"{path}: not a lease secret (hex, at least 16 bytes)")
    return secret


def server_keys(key_dir: str) -> tuple[bytes, bytes]:
    path = os.path.join(key_dir, f"{SERVER}.key_secret")
    check_private(path)
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ChmError(errno.EINVAL, f"{path}: no secret key in it")
    return public, secret


def client_keys(spec: str) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret) of ``spec``: a key directory (its ``client`` key) or a
    client's ``NAME.key_secret`` file beside the servers' ``server.key``."""
    path = os.path.join(spec, f"{DEFAULT_CLIENT}.key_secret") if os.path.isdir(spec) else spec
    folder = os.path.dirname(path) or "."
    check_private(path)
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ChmError(errno.EINVAL, f"{path}: no secret key in it (a client needs its NAME.key_secret)")
    server_public, _ = zmq.auth.load_certificate(os.path.join(folder, f"{SERVER}.key"))
    return server_public, public, secret


# ------------------------------------------------------------------------------------------ ZAP

class _Authenticator(ThreadAuthenticator):
    """One per ZeroMQ context (ZAP has one endpoint per context): each server socket has a ZAP domain of its
    own, mapped to its key directory's allow-list, reloaded when ``authorized/`` changes."""

    def __init__(self, context: zmq.Context):
        super().__init__(context)
        self.key_dirs: dict[str, str] = {}
        self._tables: dict[str, tuple[tuple, dict]] = {}
        self._user = ""

    def _table(self, domain: str) -> dict:
        key_dir = self.key_dirs.get(domain)
        if key_dir is None:
            return {}
        folder = os.path.join(key_dir, AUTHORIZED)
        try:
            st = os.stat(folder)
            stamp = (st.st_mtime_ns, st.st_ino, len(os.listdir(folder)))
        except OSError:
            return {}
        cached = self._tables.get(domain)
        if cached is None or cached[0] != stamp:
            cached = self._tables[domain] = (stamp, load_allowed(key_dir))
        return cached[1]

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        ident = self._table(domain).get(z85.encode(client_key))
        self._user = "" if ident is None else ident.user_id()
        return (ident is not None), (b"OK" if ident is not None else b"Unknown key")

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._user  # set by _authenticate_curve just before, in this (the ZAP) thread


_zap_lock = threading.Lock()
_zaps: dict[int, _Authenticator] = {}
_domains = iter(range(1, 1 << 62))


def protect(sock: zmq.Socket, key_dir: str) -> None:
    """CurveZMQ server on ``sock`` with the servers' pair of ``key_dir``; only keys it authorizes get in."""
    public, secret = server_keys(key_dir)
    with _zap_lock:
        zap = _zaps.get(id(sock.context))
        if zap is None:
            zap = _zaps[id(sock.context)] = _Authenticator(sock.context)
            zap.start()
        domain = f"hymcache-{next(_domains)}"
        zap.key_dirs[domain] = os.path.abspath(key_dir)
    sock.zap_domain = domain.encode()
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True


def caller_of(frame) -> Identity | None:
    """The authenticated caller of a received message (one of its frames), or None without CurveZMQ."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return Identity.from_user_id(user) if user else None


def refuse(method: str, allowed, who: Identity | None) -> ChmError:
    """EACCES: ``method`` needs one of the roles ``allowed``."""
    need = " or ".join(sorted(allowed)) or "no"
    has = ",".join(sorted(who.roles)) if who and who.roles else "none"
    name = who.name if who else "?"
    return ChmError(errno.EACCES, f"{method} needs the {need} role; key {name!r} has role {has}")


# ------------------------------------------------------------------------------------------ binding

def is_loopback(endpoint: str) -> bool:
    """``endpoint`` reachable from this machine only: ipc/inproc, or tcp on a loopback address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False  # "*", an interface name, a name that does not resolve: not provably loopback
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_bind(endpoint: str, key_dir: str | None, insecure: bool) -> str | None:
    """Without keys a server binds only to loopback (EACCES); ``insecure`` allows another address: the warning to
    print once it is bound (None: nothing to warn about)."""
    if key_dir or is_loopback(endpoint):
        return None
    if not insecure:
        raise ChmError(errno.EACCES, f"endpoint {endpoint} is not loopback and there are no keys: anyone who can "
                                     "reach it could read, overwrite and remove every block. Give --curve-keys "
                                     "DIR, bind 127.0.0.1, or pass --insecure")
    return (f"WARNING: serving {endpoint} without keys (--insecure): no authentication, no encryption; anyone "
            "who can reach it can read, overwrite and remove every block")


def warn(message: str, log=None) -> None:
    (log or (lambda m: print(m, file=sys.stderr, flush=True)))(message)


# ------------------------------------------------------------------------------------------ leases

def node_secret(lease_secret: bytes, node: int) -> bytes:
    """The secret node ``node``'s Manager verifies leases with."""
    return hmac.new(lease_secret, b"hymcache-node\0" + int(node).to_bytes(4, "little"), hashlib.sha256).digest()


def _mac(secret: bytes, request_id: str, key: bytes, version: int, node: int, expiry_ms: int) -> bytes:
    body = msgspec.msgpack.encode(["hymcache-lease", request_id, bytes(key), int(version), int(node), expiry_ms])
    return hmac.new(secret, body, hashlib.sha256).digest()


def now_ms() -> int:
    return int(time.time() * 1000)


def lease_token(secret: bytes, request_id: str, key: bytes, version: int, node: int, expiry_ms: int) -> bytes:
    """The capability a Master grants: expiry (Unix ms) and the MAC under the node's secret."""
    return expiry_ms.to_bytes(8, "little") + _mac(secret, request_id, key, version, node, expiry_ms)


def lease_expiry(secret: bytes, token, request_id: str, key: bytes, version: int, node: int) -> int | None:
    """The token's expiry (Unix ms) if it is the Master's lease of (request, key, version, node); else None."""
    if not isinstance(token, (bytes, bytearray, memoryview)) or len(token) != LEASE_BYTES:
        return None
    token = bytes(token)
    expiry = int.from_bytes(token[:8], "little")
    good = hmac.compare_digest(token[8:], _mac(secret, request_id, key, version, node, expiry))
    return expiry if good else None


def key_file(key_dir: str | None, name: str) -> str | None:
    """The client key spec (see ``client_keys``) of key ``name`` in ``key_dir``; None without keys."""
    return os.path.join(key_dir, f"{check_name(name)}.key_secret") if key_dir else None
