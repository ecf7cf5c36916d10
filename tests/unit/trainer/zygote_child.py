"""A stand-in rank for tests/unit/trainer/test_zygote.py: `python -m tests.unit.trainer.zygote_child OUT MODE`.

It writes what it was given (argv, environment, its command line as ps shows it,
whether an inherited fd is open) to OUT as JSON, then acts on MODE: `exit:N`
exits with N, `sleep` waits to be signalled, `raise` dies of an exception."""

import json
import os
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
fd = os.environ.get("CHILD_FD")
seen = {
    "argv": sys.argv, "env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(),
    "cmdline": open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode().strip(),
    "fd_open": fd is not None and os.path.exists(f"/proc/self/fd/{fd}"),
}
with open(out + ".tmp", "w") as f:
    json.dump(seen, f)
os.replace(out + ".tmp", out)
if mode.startswith("exit:"):
    sys.exit(int(mode.split(":", 1)[1]))
if mode == "raise":
    raise RuntimeError("the stand-in rank failed")
while mode == "sleep":
    time.sleep(0.05)
