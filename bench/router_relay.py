"""What relaying a token costs `g4serve router` (issue 25: two e4b replicas behind the router gave 1.34x one
replica at 96 QPS, with the client receiving tokens in bursts). A stand-in replica (a bare asyncio server,
no engine) answers every request with an event stream of ``--events`` server-sent events at ``--rate``
events a second; ``--streams`` clients stream through the router at once. Reported: the router's CPU
time per relayed event (from /proc, so other processes on the host do not count), the events relayed a
second, and the clients' inter-event gaps (a router that falls behind delivers events in bursts: gaps of 0
and long ones). Each ``--http`` implementation of uvicorn is one run (h11: pure Python; httptools: C).

    python bench/router_relay.py                            # h11 and httptools (where installed)
    python bench/router_relay.py --streams 64 --rate 100 --events 400
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from g4serve.bench.meta import device_name, git_commit, write_result_json  # noqa: E402

EVENT = (
    b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
)
ROUTER = """
import sys, uvicorn
from g4serve.deploy.proxy import RouterConfig, build_router_app
app = build_router_app(RouterConfig(replicas=[sys.argv[1]]))
port, http, loop = int(sys.argv[2]), sys.argv[3], sys.argv[4]
uvicorn.run(app, host="127.0.0.1", port=port, http=http, loop=loop, log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int, rate: float):
    """One HTTP/1.1 connection of the stand-in replica: GET /health is 200; anything else an event stream."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            if head.startswith(b"GET /health"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                )
                await writer.drain()
                continue
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            start = time.perf_counter()
            for i in range(events):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass  # the client or the router left, or the stand-in is shutting down
    finally:
        writer.close()


async def _client(port: int, gaps: list[float]) -> int:
    """One streamed request through the router; the events it got (gaps between reads appended)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    events, last, tail = 0, None, b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        now = time.perf_counter()
        n = (tail + data).count(b"\n\n")
        tail = (tail + data)[-1:]
        if n:
            if last is not None:
                gaps.append(now - last)
                gaps.extend([0.0] * (n - 1))
            last = now
            events += n
        if data.endswith(b"0\r\n\r\n"):
            break
    writer.close()
    return events


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(http: str, loop: str, args) -> dict:
    server = await asyncio.start_server(
        lambda r, w: _replica(r, w, args.events, args.rate), "127.0.0.1", 0, backlog=1024
    )
    replica_port = server.sockets[0].getsockname()[1]
    port = _free_port()
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, f"http://127.0.0.1:{replica_port}", str(port), http, loop],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )
    try:
        for _ in range(200):
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the router's first health check
        await asyncio.gather(*(_client(port, []) for _ in range(4)))  # warm-up
        gaps: list[float] = []
        cpu0, t0 = _cpu_s(router.pid), time.perf_counter()
        counts = await asyncio.gather(*(_client(port, gaps) for _ in range(args.streams)))
        wall, cpu = time.perf_counter() - t0, _cpu_s(router.pid) - cpu0
    finally:
        router.terminate()
        router.wait(10)
        server.close()
    relayed = sum(counts)
    gaps.sort()
    return {
        "http": http,
        "loop": loop,
        "events": relayed,
        "expected_events": args.streams * (args.events + 1),
        "wall_s": wall,
        "events_per_s": relayed / wall,
        "offered_events_per_s": args.streams * args.rate,
        "router_cpu_s": cpu,
        "router_cpu_us_per_event": cpu / relayed * 1e6,
        "router_cpu_share": cpu / wall,
        "gap_p50_ms": gaps[len(gaps) // 2] * 1e3,
        "gap_p99_ms": gaps[int(len(gaps) * 0.99)] * 1e3,
        "gaps_zero_share": sum(g < 1e-4 for g in gaps) / len(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rate", type=float, default=100.0, help="events a second per stream (an ITL of 10 ms)")
    p.add_argument("--events", type=int, default=300)
    p.add_argument("--http", default="h11,httptools")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    rows = []
    for http in args.http.split(","):
        if http == "httptools" and importlib.util.find_spec("httptools") is None:
            print("httptools is not installed: skipped")
            continue
        row = asyncio.run(_run(http, loop, args))
        rows.append(row)
        print(
            f"{http:9s} ({loop}): {row['events_per_s']:7.0f} events/s of {row['offered_events_per_s']:.0f} "
            f"offered, router {row['router_cpu_us_per_event']:5.1f} us CPU an event "
            f"({row['router_cpu_share']:.0%} of a core), gaps p50 {row['gap_p50_ms']:.1f} / p99 "
            f"{row['gap_p99_ms']:.1f} ms, {row['gaps_zero_share']:.0%} zero",
            flush=True,
        )
    result = {
        "benchmark": "router_relay",
        "git_commit": git_commit(),
        "device": device_name("cpu"),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", *sys.argv]),
        "streams": args.streams,
        "rate": args.rate,
        "events_per_stream": args.events,
        "rows": rows,
    }
    print(f"wrote {write_result_json(args.out, 'router-relay', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
