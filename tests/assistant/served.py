"""An ASGI app served by uvicorn on 127.0.0.1 and a free port, from a daemon thread: the browser test's
assistant and the fake bank HTTPBank talks to are real servers on real sockets."""

from __future__ import annotations

import threading
import time

import uvicorn


class UvicornThread:
    """``with UvicornThread(app) as server: server.url``. Port 0 and uvicorn's own socket: a socket bound
    here and handed over answered 40 ms late (Nagle and delayed ACKs), 2 ms this way."""

    def __init__(self, app, lifespan: str = "auto", start_timeout_s: float = 20.0):
        self.url = ""
        self._timeout_s = start_timeout_s
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + self._timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
