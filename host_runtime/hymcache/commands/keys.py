"""``chm hymcache keys add|list``: the key directory's clients."""

from __future__ import annotations

import errno
import json
import os

from driver.errors import ChmError


def _auth_roles() -> tuple:
    from ..auth import ROLES

    return ROLES


def _keys_add(args) -> int:
    from .. import auth

    auth.make_keys(args.dir)  # the servers' pair and the lease secret, if this is a new directory
    path = auth.add_key(args.dir, args.name, args.role, args.node)
    print(f"chm hymcache keys: {args.name} ({args.role}{'' if args.node is None else f', node {args.node}'}) "
          f"authorized in {args.dir}; give the client {path} and {os.path.join(args.dir, 'server.key')}", flush=True)
    return 0


def _keys_list(args) -> int:
    from .. import auth

    if not os.path.isdir(args.dir):
        raise ChmError(errno.ENOENT, f"--dir {args.dir}: no such key directory")
    keys = auth.list_keys(args.dir)
    if args.json:
        print(json.dumps(keys))
    else:
        for k in keys:
            print(f"{k['name']:<24} {','.join(k['roles']):<20} {'' if k['node'] is None else 'node ' + str(k['node'])}")
    return 0
