"""How long reading one large chat body holds the event loop (issue 23: "HTTP body parsing and base64 go
off the event loop"). A heartbeat task measures the loop's longest gap while ``read_json_object`` reads a
body carrying one video data: URL, fed in 64 KB chunks that are all there already (as on a fast link), and
the media is decoded as the server does (``decode_data_url``). Against it, the way bodies were read before
the streaming reader: join, ``json.loads``, then ``b64decode`` at decode time.

    python bench/body_stall.py                          # 1, 4, 16, 64 MB of video
    python bench/body_stall.py --sizes-mb 16 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from g4serve.bench.meta import result_header, write_result_json  # noqa: E402
from g4serve.processing.chat import decode_data_url  # noqa: E402
from g4serve.server.errors import parse_json_object, read_json_object  # noqa: E402

CHUNK = 1 << 16


class _Request:
    """What ``read_json_object`` reads of a Starlette request: its body, chunk by chunk."""

    def __init__(self, raw: bytes):
        self.raw = raw

    async def stream(self):
        for i in range(0, len(self.raw), CHUNK):
            yield self.raw[i : i + CHUNK]


async def _streamed(raw: bytes) -> bytes:
    body = await read_json_object(_Request(raw), len(raw))
    return decode_data_url(body["messages"][0]["content"][0]["video_url"]["url"], "video")


async def _whole(raw: bytes) -> bytes:
    """Before: the chunks joined and parsed at once, the payload decoded at once (two loop steps)."""
    chunks = [chunk async for chunk in _Request(raw).stream()]
    body = parse_json_object(b"".join(chunks))
    await asyncio.sleep(0)
    return decode_data_url(body["messages"][0]["content"][0]["video_url"]["url"], "video")


async def _measure(read, raw: bytes, payload: bytes) -> dict:
    gaps: list[float] = []
    done = False

    async def heartbeat():
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    gaps.clear()
    t0 = time.perf_counter()
    got = await read(raw)
    total = time.perf_counter() - t0
    done = True
    await task
    assert got == payload
    return {"total_ms": total * 1e3, "max_gap_ms": max(gaps) * 1e3, "loop_steps": len(gaps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1,4,16,64", help="decoded video sizes")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    rows = []
    for size_mb in [float(s) for s in args.sizes_mb.split(",")]:
        payload = os.urandom(int(size_mb * (1 << 20)))
        url = "data:video/mp4;base64," + base64.b64encode(payload).decode()
        raw = json.dumps(
            {
                "model": "g4serve-tiny",
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}],
            }
        ).encode()
        for name, read in (("whole", _whole), ("streamed", _streamed)):
            runs = [asyncio.run(_measure(read, raw, payload)) for _ in range(args.reps)]
            row = {
                "reader": name,
                "video_mb": size_mb,
                "body_mb": len(raw) / (1 << 20),
                "max_gap_ms_median": statistics.median(r["max_gap_ms"] for r in runs),
                "max_gap_ms_worst": max(r["max_gap_ms"] for r in runs),
                "total_ms_median": statistics.median(r["total_ms"] for r in runs),
                "runs": runs,
            }
            rows.append(row)
            print(
                f"{size_mb:5.0f} MB video, {name:8s}: longest loop stall {row['max_gap_ms_median']:7.1f} ms "
                f"(worst {row['max_gap_ms_worst']:.1f}), read + decode {row['total_ms_median']:.1f} ms",
                flush=True,
            )
    result = {
        **result_header("body_stall", "cpu"),
        "chunk_bytes": CHUNK,
        "reps": args.reps,
        "rows": rows,
    }
    write_result_json(args.out, "body-stall", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
