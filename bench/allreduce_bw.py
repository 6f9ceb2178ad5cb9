"""All-reduce bandwidth of the machine's GPUs (or CPU processes): N processes, one per GPU, sum tensors of
rising size with torch.distributed, and report each size's time, algorithm bandwidth (bytes / time) and bus
bandwidth (algbw * 2 (N - 1) / N, NCCL's measure of the link). The figure tensor parallel's per-step
all-reduces are compared against (issue 25).

    python3 bench/allreduce_bw.py --world-size 2                  # NCCL over cuda:0..1
    python3 bench/allreduce_bw.py --world-size 2 --device cpu     # gloo (a smoke test)
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from g4serve.bench.meta import command_line, device_name, git_commit, write_result_json  # noqa: E402


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    rows = []
    for size in args.sizes:
        x = torch.ones(size // 2, dtype=torch.bfloat16 if cuda else torch.float16, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.iters
        algbw = size / seconds / 1e9
        rows.append(
            {
                "bytes": size,
                "time_us": seconds * 1e6,
                "algbw_gb_s": algbw,
                "busbw_gb_s": algbw * 2 * (world - 1) / world,
            }
        )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--sizes", default="8K,64K,512K,4M,32M,256M", help="bytes per all-reduce (K, M suffixes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    args.sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in args.sizes.split(",")]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(target=_rank, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=600)
    for proc in procs:
        proc.join()
    print(f"| bytes | time (us) | algbw (GB/s) | busbw (GB/s) |  ({args.world_size} ranks, {args.device})")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['bytes']:,} | {row['time_us']:.1f} | {row['algbw_gb_s']:.1f} | {row['busbw_gb_s']:.1f} |"
        )
    result = {
        "git_commit": git_commit(),
        "device_name": device_name(args.device),
        "torch_version": torch.__version__,
        "command": command_line(),
        "world_size": args.world_size,
        "device": args.device,
        "rows": rows,
    }
    write_result_json(args.out, f"allreduce-{args.device}-x{args.world_size}", result)
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
