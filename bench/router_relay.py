"""What relaying a token costs `g4serve router` (issue 25: two e4b replicas behind the router gave 1.34x one
replica at 96 QPS, with the client receiving tokens in bursts). A stand-in replica (a bare asyncio server in
a process of its own, no engine) answers every streamed request with ``--events`` server-sent events at
``--rate`` events a second, anything else with ``{}``; ``--streams`` clients stream through the router at
once. Reported: the router's CPU time per relayed event (from /proc, so other processes on the host do not
count), the events relayed a second, and the clients' inter-event gaps (a router that falls behind delivers
events in bursts: gaps of 0 and long ones). Each ``--http`` implementation of uvicorn is one run (h11: pure
Python; httptools: C).
With ``--media-mb``, requests carrying an image data: URL of that size are posted through the router
meanwhile, one every ``--media-every`` seconds: how long keying them holds the streams (the gaps' maximum).
``--src`` runs the router from another checkout's sources (a before/after of the router).

    python bench/router_relay.py                            # h11 and httptools (where installed)
    python bench/router_relay.py --streams 64 --rate 100 --events 400
    python bench/router_relay.py --http httptools --media-mb 16 --media-every 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from g4serve.bench.meta import result_header, write_result_json  # noqa: E402

EVENT = (
    b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
)
_STREAM = re.compile(rb'"stream"\s*:\s*true')
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


def _usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    return b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
    )


async def _replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int, rate: float):
    """One HTTP/1.1 connection of the stand-in replica: a streamed chat request gets ``events`` chunks at
    ``rate`` a second (and a usage chunk if asked), anything else a one-token answer; a body's prompt counts
    a token per 4 bytes."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            prompt = len(body) // 4
            if head.startswith(b"GET /health") or not _STREAM.search(body):
                answer = (
                    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"x"},'
                    b'"finish_reason":"length"}],' + _usage(prompt, 1) + b"}"
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(answer), answer)
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
            tail = b""
            if b"include_usage" in body:
                tail = b'data: {"id":"chatcmpl-0","choices":[],' + _usage(prompt, events) + b"}\n\n"
            tail += b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass  # the client or the router left, or the stand-in is shutting down
    finally:
        writer.close()


async def _post(port: int, body: bytes) -> None:
    """One non-streamed request with ``body`` through the router, its answer read whole."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    for i in range(0, len(body), 1 << 16):
        writer.write(body[i : i + (1 << 16)])
        await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ),
        None,
    )
    if length is not None:
        await reader.readexactly(length)
    else:  # chunked
        await reader.readuntil(b"0\r\n\r\n")
    writer.close()


async def _media_load(port: int, megabytes: float, every_s: float, seconds: float) -> int:
    """Posts of one image data: URL of ``megabytes`` (a fresh one each time) for ``seconds``; how many.
    Runs in a process of its own (``--post-media``), so that its uploads are not paced by this one's loop."""
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        url = "data:image/png;base64," + base64.b64encode(os.urandom(int(megabytes * (1 << 20)))).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
        await _post(port, body)
        sent += 1
        await asyncio.sleep(every_s)
    return sent


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


async def _stand_in(port: int, events: int, rate: float) -> None:
    """The stand-in replica's own process (``--stand-in``), serving until killed."""
    server = await asyncio.start_server(
        lambda r, w: _replica(r, w, events, rate), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


async def _run(http: str, loop: str, args) -> dict:
    replica_port, port = _free_port(), _free_port()
    stand_in = subprocess.Popen(
        [sys.executable, __file__, "--stand-in", str(replica_port), str(args.events), str(args.rate)]
    )
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER, f"http://127.0.0.1:{replica_port}", str(port), http, loop],
        env={**os.environ, "PYTHONPATH": args.src},
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
        poster = None
        if args.media_mb:
            seconds = args.events / args.rate
            poster = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--post-media",
                str(port),
                str(args.media_mb),
                str(args.media_every),
                str(seconds),
                stdout=asyncio.subprocess.PIPE,
            )
        cpu0, t0 = _cpu_s(router.pid), time.perf_counter()
        counts = await asyncio.gather(*(_client(port, gaps) for _ in range(args.streams)))
        wall, cpu = time.perf_counter() - t0, _cpu_s(router.pid) - cpu0
        media_posts = int((await poster.communicate())[0]) if poster else 0
    finally:
        for process in (router, stand_in):
            process.terminate()
            process.wait(10)
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
        "gap_max_ms": gaps[-1] * 1e3,
        "media_mb": args.media_mb,
        "media_posts": media_posts,
    }


def media_posts_text(row: dict) -> str:
    return f"{row['media_posts']} posts of {row['media_mb']:g} MB meanwhile"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rate", type=float, default=100.0, help="events a second per stream (an ITL of 10 ms)")
    p.add_argument("--events", type=int, default=300)
    p.add_argument("--http", default="h11,httptools")
    p.add_argument("--media-mb", type=float, default=0.0, help="post image bodies of this size meanwhile")
    p.add_argument("--media-every", type=float, default=0.5, help="seconds between the media posts")
    p.add_argument(
        "--src", default=str(Path(__file__).resolve().parents[1] / "src"), help="the router's sources"
    )
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
            f"{row['gap_p99_ms']:.1f} / max {row['gap_max_ms']:.1f} ms, {row['gaps_zero_share']:.0%} zero"
            + (f"; {media_posts_text(row)}" if row["media_posts"] else ""),
            flush=True,
        )
    result = {
        **result_header("router_relay", "cpu"),
        "streams": args.streams,
        "rate": args.rate,
        "events_per_stream": args.events,
        "router_src": args.src,
        "rows": rows,
    }
    write_result_json(args.out, "router-relay", result)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stand-in"]:  # the stand-in replica's own process (see _run)
        port, events, rate = sys.argv[2:5]
        asyncio.run(_stand_in(int(port), int(events), float(rate)))
    if sys.argv[1:2] == ["--post-media"]:  # the media poster's own process (see _run)
        port, megabytes, every_s, seconds = sys.argv[2:6]
        print(asyncio.run(_media_load(int(port), float(megabytes), float(every_s), float(seconds))))
        raise SystemExit(0)
    raise SystemExit(main())
