"""A request written byte by byte on a raw socket, for the tests of what a server does with a body that
arrives late, slowly or never (what an HTTP client library will not send)."""

from __future__ import annotations

import socket


def open_body(
    base_url: str, path: str, length: int, sent: bytes, headers: dict[str, str] | None = None
) -> socket.socket:
    """A connection whose JSON POST to ``path`` declared ``length`` bytes of body and sent only ``sent``."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=20)
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: g4serve\r\nContent-Type: application/json\r\n{extra}"
        f"Connection: close\r\nContent-Length: {length}\r\n\r\n"
    )
    s.sendall(head.encode() + sent)
    return s


def read_answer(s: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, headers lowercased, body) of the answer, read until the server closes the connection."""
    answer = b""
    while data := s.recv(1 << 16):
        answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), headers.lower(), body
