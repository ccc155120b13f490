"""Remove each mechanism of issue #21 on purpose, run the tests that guard it, and put it back: each line must
say FAILS. It edits the sources in place (restored after each), so run it in a scratch clone after make setup:

    git clone . /tmp/m && cd /tmp/m && make setup && .venv/bin/python tests/mutants.py [NAME ...]
"""
import subprocess, sys, os
ROOT = os.getcwd()
PY = ".venv/bin/python"
MUTANTS = [
    ("ring: len past the capacity (C check)", "emulator/serve/chm_srv.c",
     "        if (e->len > capacity - e->addr)    /* addr + len, without the sum */\n            BAD(CHM_SQE_LEN, ERANGE);\n", "",
     [PY, "-m", "emulator.serve.srv_build"],
     ["tests/emulator/serve/test_ring_fields.py", "-k", "test_len or reproduction"]),
    ("ring: fuzzer without the len check", "emulator/serve/chm_srv.c",
     "        if (e->len > capacity - e->addr)    /* addr + len, without the sum */\n            BAD(CHM_SQE_LEN, ERANGE);\n", "",
     [PY, "-m", "emulator.serve.srv_build"],
     ["tests/emulator/serve/test_ring_fuzz.py", "-k", "fuzz_the_queue_pair"]),
    ("ring: reserved field rsvd1 unchecked", "emulator/serve/chm_srv.c",
     "    if (e->rsvd1)\n        BAD(CHM_SQE_RSVD1, EINVAL);\n", "",
     [PY, "-m", "emulator.serve.srv_build"],
     ["tests/emulator/serve/test_ring_fields.py", "-k", "reserved"]),
    ("ZAP allow-list", "host_runtime/hymcache/auth.py",
     'return (ident is not None), (b"OK" if ident is not None else b"Unknown key")', 'return True, b"OK"', None,
     ["tests/host_runtime/hymcache/test_auth.py", "-k", "outside_the_allow_list"]),
    ("role check", "host_runtime/hymcache/rpc.py",
     "            if self.roles is not None and not (who and who.roles & self.roles.get(method, frozenset())):",
     "            if False:", None,
     ["tests/host_runtime/hymcache/test_auth.py", "-k", "outside_the_keys_role"]),
    ("lease check", "host_runtime/hymcache/manager_hints.py",
     "        if why is not None:\n            self.counters[\"reads_refused\"] += 1",
     "        if False:\n            self.counters[\"reads_refused\"] += 1", None,
     ["tests/host_runtime/hymcache/test_auth.py", "-k", "lease"]),
    ("secret file mode check", "host_runtime/hymcache/auth.py", "    if mode & 0o077:", "    if False:", None,
     ["tests/host_runtime/hymcache/test_auth.py", "-k", "secrets"]),
    ("loopback-only bind without keys", "host_runtime/hymcache/auth.py",
     "    if key_dir or is_loopback(endpoint):", "    if True:", None,
     ["tests/host_runtime/hymcache/test_auth.py", "-k", "non_loopback"]),
    ("journal: cut back a failed write", "host_runtime/hymcache/journal.py",
     "            os.ftruncate(self.fd, end)\n", "            pass\n", None,
     ["tests/host_runtime/hymcache/test_journal.py", "-k", "failed_write or full_state_disk"]),
    ("per-client doorbell", "emulator/serve/connections.py",
     "                self._reply(conn, 0, cid, total, (fd, c.bell))", "                self._reply(conn, 0, cid, total, (fd, self.evfd))", None,
     ["tests/emulator/serve/test_doorbell.py"]),
]
only = sys.argv[1:]
for name, path, old, new, build, test in MUTANTS:
    if only and not any(o in name for o in only):
        continue
    text = open(path).read()
    assert text.count(old) == 1, (name, text.count(old))
    try:
        open(path, "w").write(text.replace(old, new))
        if build:
            subprocess.run(build, check=True, capture_output=True)
        env = dict(os.environ, CHM_FUZZ_ROUNDS="400")
        r = subprocess.run([PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *test], capture_output=True,
                           text=True, env=env)
        last = [l for l in r.stdout.splitlines() if l.strip()][-1]
        print(f"{'FAILS (good)' if r.returncode else 'PASSES (bad)'}  {name}: {last}", flush=True)
    finally:
        open(path, "w").write(text)
        if build:
            subprocess.run(build, check=True, capture_output=True)
