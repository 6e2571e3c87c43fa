"""What the emulated link itself carries: one direction at a time against both at once.

Two hosts (network namespaces, each link shaped by ``tc tbf`` as in ``bench/mlp.py --link``)
exchange SIZE bytes over one TCP stream each way, first one way only, then both ways at once, the
two alternated ``--rounds`` times. A step of a 2-worker, 2-server job on these links moves about
the model once up and once down on every host, as each rank of a 2-rank ring allreduce does, so the
both-ways time is the floor of such a step (compute aside) for shoal and DDP alike.

    .venv/bin/python bench/link.py [--link 1gbit] [--mb 33.6] [--rounds 3]     # needs root

One JSON object per case (median of the rounds), then the ratio of the two.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time

from _hosts import Placement, enter

CTX = mp.get_context("spawn")


def _peer(namespace: str | None, size: int, send: bool, receive: bool, ports: mp.Queue, peer: mp.Queue,
          out: mp.Queue) -> None:
    enter(namespace)
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    ports.put(server.getsockname()[1])
    host, port = peer.get()
    payload = bytearray(size)

    def receiver() -> None:
        conn, _ = server.accept()
        view, got = memoryview(bytearray(1 << 20)), 0
        while got < size:
            n = conn.recv_into(view)
            if not n:
                raise ConnectionError("the sender closed early")
            got += n
        conn.close()

    def sender() -> None:
        with socket.create_connection((host, port)) as s:
            s.sendall(payload)

    threads = ([threading.Thread(target=sender)] if send else []) + \
        ([threading.Thread(target=receiver)] if receive else [])
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(time.perf_counter() - t0)
    server.close()


def exchange(place: Placement, size: int, both: bool, a_role: str = "a", b_role: str = "b") -> float:
    """Seconds until SIZE bytes crossed a->b (and b->a at the same time when ``both``)."""
    qa, qb, to_a, to_b, out = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    a = CTX.Process(target=_peer, args=(place.namespace(a_role), size, True, both, qa, to_a, out))
    b = CTX.Process(target=_peer, args=(place.namespace(b_role), size, both, True, qb, to_b, out))
    a.start()
    b.start()
    to_a.put((place.address(b_role), qb.get(timeout=60)))
    to_b.put((place.address(a_role), qa.get(timeout=60)))
    seconds = max(out.get(timeout=300), out.get(timeout=300))
    a.join(60)
    b.join(60)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="tc rate of every host's link, each way")
    p.add_argument("--mb", type=float, default=33.6, help="megabytes each way (default: bench/mlp.py's model)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    size = int(args.mb * 1e6)
    times: dict[str, list[float]] = {"one-way": [], "both-ways": []}
    with Placement(["a", "b"], args.link) as place:
        for _ in range(args.rounds):
            times["one-way"].append(exchange(place, size, both=False))
            times["both-ways"].append(exchange(place, size, both=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    for case, seconds in med.items():
        print(json.dumps({"case": case, "link": args.link, "bytes_each_way": size, "ms": round(seconds * 1e3, 1),
                          "ms_per_round": [round(s * 1e3, 1) for s in times[case]],
                          "gb_per_s_each_way": round(size / seconds / 1e9, 4)}), flush=True)
    print(json.dumps({"case": "both-ways / one-way", "ratio": round(med["both-ways"] / med["one-way"], 3)}))


if __name__ == "__main__":
    main()
