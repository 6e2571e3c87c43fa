"""The worker's CUDA path, checked on a GPU; one JSON object per case.

    python bench/cuda_check.py                 # needs a CUDA device
    python bench/cuda_check.py --cases codecs  # codecs, staging, amp
    python bench/cuda_check.py --cases amp --device cpu   # a dry run of the amp case (bf16, no scaler)

- ``codecs``: every codec encodes the same tensor on the GPU and on the CPU; the
  decoded results must agree (``max_abs_diff``) and the GPU's encode time is set
  against the CPU's (``speedup``).
- ``staging``: a shard's gradients leave the GPU through the pinned host buffers
  of ``worker/staging.py``; the copy rate is set against a plain ``.cpu()`` copy.
- ``amp``: a CUDA model under fp16 autocast with a ``GradScaler`` trains through
  ``DistributedOptimizer`` on an in-process cluster with int8 compression; one
  step is made to overflow. The scaler must skip it with nothing pushed, every
  batch must reach each shard exactly once, and the worker's weights must equal
  the shards'.

CI has no GPU: the CPU versions of these checks are tests (tests/unit/test_codecs.py,
tests/unit/test_staging.py, tests/integration/test_user_loop.py); this script is
for a machine that has one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import InProcessCluster  # noqa: E402
from shoal.codecs import get_codec, known_codecs  # noqa: E402
from shoal.settings.config import JobConfig  # noqa: E402
from shoal.worker import DistributedOptimizer, DistributedSampler  # noqa: E402
from shoal.worker.staging import Staging  # noqa: E402


def timed(fn, repeat: int = 7) -> float:
    """Median seconds of ``fn()`` after one warm-up, the GPU synchronised around each call."""
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def codecs(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    xg = x.cuda()
    for name in sorted(known_codecs()):
        codec = get_codec(name)
        cpu, gpu = codec.encode(x), codec.encode(xg)
        diff = (codec.decode(cpu, numel) - codec.decode(gpu, numel)).abs().max().item()
        t_cpu, t_gpu = timed(lambda: codec.encode(x)), timed(lambda: codec.encode(xg))
        print(json.dumps({"case": "codec", "codec": name, "numel": numel, "bytes_equal": cpu == gpu,
                          "payload_bytes": len(gpu), "max_abs_diff": diff, "cpu_ms": round(t_cpu * 1e3, 3),
                          "gpu_ms": round(t_gpu * 1e3, 3), "speedup": round(t_cpu / t_gpu, 2)}), flush=True)


def staging(numel: int) -> None:
    w, g = torch.zeros(numel, device="cuda"), torch.randn(numel, device="cuda")
    half = numel // 2
    s = Staging(w, g, [(0, half), (half, numel)])

    def pinned() -> None:
        ready = s.grads_ready()
        for shard in range(2):
            s.host_grads(shard, ready)

    t_pinned, t_plain = timed(pinned), timed(lambda: g.cpu())
    host = torch.cat([s.host_grads(0, s.grads_ready()), s.host_grads(1, s.grads_ready())])
    gb = numel * 4 / 1e9
    print(json.dumps({"case": "staging", "numel": numel, "pinned": s.host_grads(0, None).is_pinned(),
                      "copy_equal": torch.equal(host, g.cpu()), "pinned_GBps": round(gb / t_pinned, 2),
                      "pageable_GBps": round(gb / t_plain, 2), "speedup": round(t_plain / t_pinned, 2)}),
          flush=True)


def amp(device: torch.device, epochs: int, overflow_at: int) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from cnn_bn import build_model
    from digits import load

    torch.manual_seed(0)
    (xtr, ytr), (xte, yte) = load(0)
    n = (len(xtr) // 32) * 32
    ds = TensorDataset(torch.arange(n), xtr[:n].view(-1, 1, 8, 8), ytr[:n])
    with InProcessCluster(num_ps=2, job=JobConfig(mode="async", num_shards=2)) as c:
        model = build_model().to(device)
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.003), model,
                                   chief=c.chief_address, compression="int8")
        fp16 = device.type == "cuda"
        scaler = torch.amp.GradScaler(device.type)
        loader = DataLoader(ds, batch_size=32, pin_memory=fp16,
                            sampler=DistributedSampler(ds, batch_size=32, epochs=epochs, seed=1))
        steps = skipped = pushes_before = 0
        t0 = time.perf_counter()
        try:
            for _ in range(epochs):
                for _, x, y in loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    opt.zero_grad()
                    with torch.autocast(device.type, dtype=torch.float16 if fp16 else torch.bfloat16):
                        loss = F.cross_entropy(model(x), y)
                    if steps + skipped == overflow_at:
                        loss = loss * float("inf")
                    pushes_before = opt.trainer.step_count
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    if opt.trainer.step_count > pushes_before:
                        steps += 1
                    else:
                        skipped += 1
            elapsed = time.perf_counter() - t0
            opt.synchronize()
            model.eval()
            with torch.no_grad():
                acc = (model(xte.view(-1, 1, 8, 8).to(device)).argmax(1).cpu() == yte).float().mean().item()
            weights = opt.trainer.flat_weights.cpu()         # the parameters, then the BatchNorm buffers
        finally:
            opt.close()
        shards = [next(s.host.shards[i] for s in c.servers if s.host.roles.get(i) == "primary")
                  for i in range(2)]
        counts = [count for sh in shards for e in range(epochs) for count in sh.ledger.starts(e).values()]
        batches = [len(sh.ledger.starts(e)) for sh in shards for e in range(epochs)]
        on_shards = torch.cat([sh.values() for sh in shards])
    print(json.dumps({"case": "amp", "epochs": epochs, "steps": steps, "skipped": skipped,
                      "batches_per_epoch_per_shard": sorted(set(batches)), "expected_batches": n // 32,
                      "exactly_once": set(counts) == {1} and set(batches) == {n // 32},
                      "versions": [sh.version for sh in shards],
                      "weights_equal_shards": torch.equal(weights, on_shards),
                      "test_accuracy": round(acc, 4), "steps_per_s": round(steps / elapsed, 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="codecs,staging,amp")
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    cases = set(args.cases.split(","))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"cuda_check: torch {torch.__version__} sees no CUDA device")
    if device.type != "cuda" and cases - {"amp"}:
        sys.exit("cuda_check: only the amp case runs without CUDA (--cases amp --device cpu)")
    print(json.dumps({"case": "device", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__}), flush=True)
    if "codecs" in cases:
        codecs(args.numel)
    if "staging" in cases:
        staging(args.numel)
    if "amp" in cases:
        amp(device, args.epochs, overflow_at=5)


if __name__ == "__main__":
    main()
