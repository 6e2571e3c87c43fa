#!/usr/bin/env python3
"""A pytest fork server for mutation testing: one interpreter imports the heavy libraries once, and every
test run is a fork of it.

Most of a mutant's test run here was starting Python and importing torch, grpc and numpy (8-20 s of a
10-25 s run on 2 shared cores). The server imports them once and never imports ``shoal``; each run forks
it, so the child imports the module under test afresh, from whatever cosmic-ray just wrote to disk.

    python scripts/pytest_forkserver.py --serve SOCKET            # scripts/mutate.py starts it
    python scripts/pytest_forkserver.py --client SOCKET -- -x -q tests/unit/test_x.py

The client is the test command cosmic-ray runs: it exits with pytest's status and prints its output.
When cosmic-ray kills it (the per-mutant timeout), the server sees the connection close and kills the
fork's process group, so a mutant that loops for ever does not outlive its timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading

# not hypothesis: it is a pytest plugin, which pytest wants to import itself (to rewrite its asserts)
PRELOAD = ("numpy", "torch", "grpc", "google.protobuf", "lz4.frame", "cryptography", "pytest", "yaml",
           "prometheus_client")


def _child(request: dict, out_path: str) -> None:
    """In the fork: run pytest as ``python -m pytest ARGS`` would in ``cwd``, then leave at once."""
    code = 3
    try:
        os.setsid()
        fd = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(request["cwd"])
        if sys.path and sys.path[0] != request["cwd"]:
            sys.path.insert(0, request["cwd"])        # as ``python -m`` puts the working directory first
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import pytest

        code = int(pytest.main(request["args"]))
    except BaseException as exc:  # noqa: BLE001 - any failure is the run's failure
        print(f"forkserver: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _watch(conn: socket.socket, pid: int, out_path: str) -> None:
    """Waits for the fork; kills its group if the client goes away first; sends back output and status."""
    done = threading.Event()

    def client_gone() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        if not done.is_set():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    threading.Thread(target=client_gone, daemon=True).start()
    _, status = os.waitpid(pid, 0)
    done.set()
    code = os.waitstatus_to_exitcode(status)
    try:
        with open(out_path, "rb") as f:
            output = f.read()[-200_000:]
        conn.sendall(len(output).to_bytes(8, "big") + output + int(code).to_bytes(4, "big", signed=True))
    except OSError:
        pass
    finally:
        conn.close()
        os.unlink(out_path)


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if any(m == "shoal" or m.startswith("shoal.") for m in sys.modules):
        raise SystemExit("forkserver: shoal was imported before forking: mutants would not be loaded")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    srv.bind(path)
    srv.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn.makefile("rb") as f:
            line = f.readline()
        try:
            request = json.loads(line)
        except ValueError:
            conn.close()
            continue
        fd, out_path = tempfile.mkstemp(prefix="forkserver-")
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            srv.close()
            _child(request, out_path)
        threading.Thread(target=_watch, args=(conn, pid, out_path), daemon=True).start()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the fork server closed the connection")
        buf += chunk
    return buf


def client(path: str, args: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall(json.dumps({"cwd": os.getcwd(), "args": args}).encode() + b"\n")
    size = int.from_bytes(_recv_exact(conn, 8), "big")
    sys.stdout.buffer.write(_recv_exact(conn, size))
    sys.stdout.flush()
    return int.from_bytes(_recv_exact(conn, 4), "big", signed=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", metavar="SOCKET", help="start the server on this unix socket")
    mode.add_argument("--client", metavar="SOCKET", help="run pytest with the remaining arguments in a fork")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    return client(args.client, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
