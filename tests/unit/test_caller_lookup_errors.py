"""A TCP caller whose uid the server cannot look up for want of descriptors
is not a caller from another host. identity.tcp_peer took an EMFILE from the
netlink socket and from /proc/net/tcp for "not found": the caller got
PERMISSION_DENIED saying it was not on this host, and the server logged, once
and for good, that NETLINK_SOCK_DIAG was unavailable. Now that lookup is
refused for the moment (Overloaded: RESOURCE_EXHAUSTED, retry later)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A real loopback connection, looked up by the kernel: with descriptors to
# spare, then with the soft RLIMIT_NOFILE at the lowest free descriptor (the
# next socket or open fails with EMFILE, as in a server holding as many
# connections as it may open descriptors).
SCENARIO = textwrap.dedent(
    r"""
    import json, os, resource, socket
    from pegaflow.common import identity
    from pegaflow.common.errors import Overloaded

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    port = server.getsockname()[1]
    peer = "ipv4:127.0.0.1:%d" % client.getsockname()[1]

    def lowest_free():
        fd = os.dup(0)
        os.close(fd)
        return fd

    def look_up():
        try:
            return identity.tcp_peer(peer, port).uid
        except Overloaded as exc:
            return "Overloaded: " + str(exc)

    out = {"uid": os.getuid(), "spare": look_up()}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free(), hard))
    try:
        out["none"] = look_up()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out["after"] = look_up()
    print(json.dumps(out))
    """
)


def test_a_caller_looked_up_without_a_descriptor_to_spare_is_told_to_retry() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCENARIO],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["spare"] == got["uid"]  # the kernel's lookup works here
    assert got["none"].startswith("Overloaded: caller: the server cannot open"), got
    assert "retry later" in got["none"]
    assert got["after"] == got["uid"]  # nothing was given up for good
