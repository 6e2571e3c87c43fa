"""Data-path throughput: push + pull of a 64 MB fp32 model, one worker, two shards.

Against raw TCP between two Python processes moving the same bytes (64 MB
there, 64 MB back with ``sendall`` / ``recv_into``), in the same run. Prints
one JSON object per case and the ratio. shoal runs once per transport: its TCP
data channel (the default) and gRPC, with shards not replicated (the raw TCP
side keeps no second copy either), then replicated. Steps after ``--warmup`` are timed: the
first few grow every process's heap to its working set (page faults).

    .venv/bin/python bench/wire.py [--mb 64] [--reps 10] [--warmup 3] [--security none token tls]

``--security``: each case once per mode, back to back (``token``: a job token; ``tls``: token and
mutual TLS on gRPC and the data channel), with the ratio to the same case without security.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import socket
import statistics
import time

import torch

import _security


def _tcp_echo_server(port_q: mp.Queue, nbytes: int, reps: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(reps):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(view)
    conn.close()


def tcp_round_trips(nbytes: int, reps: int) -> list[float]:
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=_tcp_echo_server, args=(q, nbytes, reps), daemon=True)
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get()))
    out = bytes(nbytes)
    back = bytearray(nbytes)
    view = memoryview(back)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        s.sendall(out)
        got = 0
        while got < nbytes:
            got += s.recv_into(view[got:], nbytes - got)
        times.append(time.perf_counter() - t)
    s.close()
    p.join()
    return times


def shoal_steps(mb: int, reps: int, warmup: int, transport: str, replicas: int) -> tuple[list[float], int]:
    from _servers import Servers

    from shoal.worker import Trainer

    numel = mb * (1 << 20) // 4
    model = torch.nn.Linear(numel // 1024, 1024, bias=False)
    with Servers(2, extra_chief=("--replicas", str(replicas))) as servers:
        trainer = Trainer(model, chief=servers.chief, optimizer="sgd", lr=1e-6, overlap=False,
                          transport=transport)
        model.weight.grad.normal_()
        for _ in range(warmup):
            trainer.step()
        times = []
        before = trainer.counters.bytes_pushed + trainer.counters.bytes_pulled
        for _ in range(reps):
            t = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - t)
        moved = (trainer.counters.bytes_pushed + trainer.counters.bytes_pulled - before) // reps
        trainer.close()
    return times, moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--transports", nargs="+", default=["tcp", "grpc"], choices=["tcp", "grpc"])
    p.add_argument("--replicated", nargs="*", default=["tcp"], choices=["tcp", "grpc"],
                   help="transports to run once more with each shard replicated on the other ps (its "
                        "forwarding is not part of the bytes counted)")
    p.add_argument("--security", nargs="+", default=["none"], choices=_security.MODES,
                   help="run each case once per mode, back to back")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    nbytes = args.mb << 20
    tcp = tcp_round_trips(nbytes, args.warmup + args.reps)[args.warmup:]
    tcp_gbps = 2 * nbytes / statistics.median(tcp) / 1e9
    print(json.dumps({"case": "raw-tcp", "mb": args.mb, "median_s": round(statistics.median(tcp), 4),
                      "gb_per_s": round(tcp_gbps, 3)}), flush=True)
    cases = [(t, 1) for t in args.transports] + [(t, 2) for t in args.replicated]
    for transport, replicas in cases:
        plain = None
        for mode in args.security:
            _security.use(mode)
            times, moved = shoal_steps(args.mb, args.reps, args.warmup, transport, replicas)
            gbps = moved / statistics.median(times) / 1e9
            plain = gbps if mode == "none" or plain is None else plain
            name = f"shoal-push-pull-{transport}" + ("-replicated" if replicas == 2 else "") + \
                ("" if mode == "none" else f"-{mode}")
            print(json.dumps({"case": name, "mb": args.mb, "shards": 2, "replicas": replicas, "security": mode,
                              "median_s": round(statistics.median(times), 4), "bytes_per_step": moved,
                              "gb_per_s": round(gbps, 3), "ratio_vs_tcp": round(gbps / tcp_gbps, 3),
                              "ratio_vs_no_security": round(gbps / plain, 3)}), flush=True)
        _security.use("none")


if __name__ == "__main__":
    main()
