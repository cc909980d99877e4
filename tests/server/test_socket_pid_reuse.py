"""The socket's caller is the process that connected (SO_PEERCRED, read at
connect()); a child that keeps the connection after that process exited
could register, over it, the memory of whichever process took its pid since:
the server checked the pid's process, which was then the successor (same
user, perhaps one the child could not ptrace). With SO_PEERPIDFD (Linux
6.5+) the server sees that the connecting process is gone and refuses.

Pid reuse is made to happen on cue as in tests/unit/test_pid_reuse.py: the
scenario runs as pid 1 of a fresh pid namespace (unshare, root), where writing
/proc/sys/kernel/ns_last_pid makes the next child take the pid just freed.
The real server runs inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.test_pid_reuse import UNSHARE, _can_unshare

pytestmark = pytest.mark.skipif(
    not _can_unshare(), reason="needs root and unshare(1) for a private pid namespace"
)

SCENARIO = textwrap.dedent(
    r"""
    import subprocess, sys, tempfile
    from pathlib import Path
    from pegaflow.client.pegaflow_client import PegaflowClient
    from pegaflow.client.registration_messages import host_request
    from pegaflow.common.geometry import LayerLayout, Segment
    from pegaflow.common.socket_frames import encode_register
    from tests.procs import HOST_ONLY, start_server

    ADDR, SIZE, PAGE = 0x7E0000000000, 1 << 20, 4096
    ENGINE = f'''
    import ctypes, sys
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long)
    assert libc.mmap({ADDR}, {SIZE}, 3, 0x22 | 0x100000, -1, 0) == {ADDR}
    ctypes.memset({ADDR}, 7, {SIZE})
    print("ready", flush=True)
    sys.stdin.read()
    '''
    # Connects and greets, then exits; its child keeps the connection and
    # sends the frame it is given.
    HOLDER = '''
    import os, socket, sys
    from pegaflow.common.socket_frames import HELLO_REPLY, encode_hello
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(encode_hello())
    assert s.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
    if os.fork():
        os._exit(0)
    s.sendall(bytes.fromhex(sys.stdin.readline()))
    head = s.recv(5, socket.MSG_WAITALL)
    print(head[0], s.recv(65536).decode(errors="replace"), flush=True)
    '''

    server = start_server(Path(tempfile.mkdtemp()), "--pool-size", "16mb", *HOST_ONLY)
    engine = None
    try:
        with PegaflowClient(server.addr) as client:
            path = client._server_info().socket_path
        # The server's own threads share this pid namespace: one may take
        # the freed pid first. Then the cycle runs again.
        for attempt in range(5):
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            holder.wait()  # the connecting process is gone (reaped)
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(holder.pid - 1))
            engine = subprocess.Popen([sys.executable, "-c", ENGINE],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert engine.stdout.readline() == b"ready\n"
            if engine.pid == holder.pid:
                break
            engine.kill()
            holder.stdin.close()  # its child sends nothing, waits for the server
        assert engine.pid == holder.pid, (engine.pid, holder.pid)
        layers = [
            LayerLayout(0, i * 16 * PAGE, 16, PAGE, (Segment(0, PAGE),))
            for i in range(4)
        ]
        req = host_request("eng", "ns", engine.pid, [(ADDR, SIZE)], layers)
        frame = encode_register(req.SerializeToString(), 0)
        holder.stdin.write(frame.hex() + "\n")
        holder.stdin.flush()
        print(holder.stdout.readline().strip())
    finally:
        if engine is not None:
            engine.kill()
        server.stop()
    """
)


def test_a_connection_outliving_its_process_cannot_register_a_successor(
    tmp_path: Path,
) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [*UNSHARE, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("7 register: the process that opened this connection"), (
        out.stdout
    )
    assert "has exited" in line, line
