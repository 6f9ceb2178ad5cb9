"""``make check-no-extras``: ``pip install g4serve`` with no extras serves every modality.

Builds ``.venv-noextras`` with this checkout installed as a plain (non-editable) package under
``constraints.txt``, checks that none of the ``assistant`` extra's libraries came with it, starts
``g4serve serve`` on the embedded tiny model from outside the checkout, and sends one chat request per
modality (text, and the packaged sample image, video and audio as base64 data). Exits non-zero on any
failure. Not part of ``make test``: the install alone takes minutes on a fresh machine.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-noextras"
EXTRA_MODULES = ("rapidfuzz", "jellyfish", "text_to_num", "silero_vad", "pocketsphinx", "websockets")
PORT = int(os.environ.get("PORT", "8799"))


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def request_bodies() -> dict[str, dict]:
    samples = ROOT / "src" / "g4serve" / "assets" / "samples"

    def b64(name: str) -> str:
        return base64.b64encode((samples / name).read_bytes()).decode()

    media = {
        "text": [],
        "image": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64("sample.png")}}],
        "video": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64("sample.mp4")}}],
        "audio": [{"type": "input_audio", "input_audio": {"data": b64("sample.wav"), "format": "wav"}}],
    }
    return {
        kind: {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
        }
        for kind, parts in media.items()
    }


def main() -> int:
    python = VENV / "bin" / "python"
    if not python.exists():
        run(sys.executable, "-m", "venv", VENV)
    run(python, "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt", ROOT)
    present = [m for m in EXTRA_MODULES if subprocess.run([python, "-c", f"import {m}"]).returncode == 0]
    if present:
        print(f"FAIL: the assistant extra's libraries came with a plain install: {present}")
        return 1
    url = f"http://127.0.0.1:{PORT}"
    with tempfile.TemporaryDirectory() as cwd:  # outside the checkout: the installed package, not src/
        server = subprocess.Popen(
            [VENV / "bin" / "g4serve", "serve", "--port", str(PORT), "--device", "cpu"], cwd=cwd
        )
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(1)
            failed = 0
            for kind, body in request_bodies().items():
                req = urllib.request.Request(
                    f"{url}/v1/chat/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                try:
                    usage = json.load(urllib.request.urlopen(req, timeout=120))["usage"]
                    print(f"{kind}: 200, {usage['prompt_tokens']} prompt tokens")
                except urllib.error.HTTPError as exc:
                    failed += 1
                    print(f"FAIL {kind}: {exc.code} {exc.read()[:300]!r}")
        finally:
            server.terminate()
            server.wait(30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
