"""Write the sample media in ``samples/``: a picture, a short video and a spoken sentence.

The files are committed; users never need to run this. To regenerate them (from a clone, in the venv):

    apt-get install espeak-ng          # the speech synthesiser (Debian/Ubuntu package)
    python src/g4serve/assets/make_samples.py            # or: python -m g4serve.assets.make_samples
    python src/g4serve/assets/make_samples.py --out /tmp/samples   # somewhere else

Everything is drawn or synthesised here, with no randomness, so the same library versions (Pillow, PyAV's
FFmpeg/x264, espeak-ng) write the same bytes. Keep the files small: they ship in every wheel.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import soundfile
from PIL import Image, ImageDraw

SAMPLES_DIR = Path(__file__).parent / "samples"

IMAGE_SIZE = (320, 240)
VIDEO_SIZE, VIDEO_FPS, VIDEO_FRAMES = (160, 120), 8, 16  # 2 s
SPEECH_TEXT = "Pay fifty pounds to Thames Water."
SAMPLE_RATE = 16_000  # what Gemma 4's audio encoder takes
SPEECH_PAD_S = 0.25  # silence either side, so a VAD sees a start and an end


# ---- image -------------------------------------------------------------------------------------------------


def draw_scene(size: tuple[int, int] = IMAGE_SIZE) -> Image.Image:
    """Sky, sun, a house with a door and windows, a tree and grass: a picture with nameable objects."""
    w, h = size
    horizon = int(h * 0.7)
    img = Image.new("RGB", size)
    d = ImageDraw.Draw(img)
    for y in range(horizon):  # sky gradient: compresses well row by row in PNG
        t = y / horizon
        d.line([(0, y), (w, y)], fill=(int(90 + 80 * t), int(160 + 60 * t), 235))
    d.rectangle([0, horizon, w, h], fill=(70, 150, 60))
    d.ellipse([w - 80, 18, w - 30, 68], fill=(255, 215, 40))
    _draw_house(d, x=int(w * 0.22), base=horizon + 10, width=110, height=70)
    _draw_tree(d, x=int(w * 0.78), base=horizon + 18)
    return img


def _draw_house(d: ImageDraw.ImageDraw, x: int, base: int, width: int, height: int) -> None:
    top = base - height
    d.rectangle([x, top, x + width, base], fill=(200, 80, 60), outline=(90, 40, 30))
    d.polygon([(x - 10, top), (x + width // 2, top - 45), (x + width + 10, top)], fill=(110, 50, 40))
    d.rectangle([x + width // 2 - 12, base - 38, x + width // 2 + 12, base], fill=(100, 60, 30))
    for wx in (x + 12, x + width - 34):
        d.rectangle([wx, top + 14, wx + 22, top + 34], fill=(180, 220, 250), outline=(255, 255, 255))


def _draw_tree(d: ImageDraw.ImageDraw, x: int, base: int) -> None:
    d.rectangle([x - 6, base - 50, x + 6, base], fill=(110, 70, 40))
    d.ellipse([x - 30, base - 100, x + 30, base - 40], fill=(40, 120, 45))


# ---- video -------------------------------------------------------------------------------------------------


def video_frames(size: tuple[int, int] = VIDEO_SIZE, n: int = VIDEO_FRAMES) -> list[np.ndarray]:
    """A yellow ball rolling left to right over a blue sky and green ground: motion a model can describe."""
    w, h = size
    frames = []
    for i in range(n):
        img = Image.new("RGB", size, (110, 170, 230))
        d = ImageDraw.Draw(img)
        d.rectangle([0, int(h * 0.75), w, h], fill=(70, 150, 60))
        cx = 15 + (w - 30) * i // (n - 1)
        d.ellipse([cx - 12, int(h * 0.75) - 24, cx + 12, int(h * 0.75)], fill=(250, 200, 30))
        frames.append(np.asarray(img))
    return frames


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = VIDEO_FPS) -> None:
    h, w = frames[0].shape[:2]
    with av.open(str(path), mode="w", format="mp4") as container:
        # One x264 thread: threaded encoding may order its decisions differently from run to run.
        stream = container.add_stream(
            "libx264", rate=fps, options={"crf": "30", "preset": "medium", "threads": "1"}
        )
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush


# ---- audio -------------------------------------------------------------------------------------------------


def synthesize_speech(text: str = SPEECH_TEXT) -> np.ndarray:
    """``text`` spoken by espeak-ng (British English), as float32 mono at 16 kHz with silence either side."""
    from g4serve.processing.audio import load_audio  # the loader users' audio goes through

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)")
    wav = subprocess.run(
        ["espeak-ng", "-v", "en-gb", "-s", "160", "--stdout", text], check=True, capture_output=True
    ).stdout
    speech = load_audio(wav, target_sr=SAMPLE_RATE)  # espeak-ng speaks at 22.05 kHz
    speech *= 0.9 / max(float(np.abs(speech).max()), 1e-6)  # same loudness whatever the voice's level
    pad = np.zeros(int(SAMPLE_RATE * SPEECH_PAD_S), np.float32)
    return np.concatenate([pad, speech, pad])


def write_wav(path: Path, audio: np.ndarray) -> None:
    soundfile.write(str(path), audio, SAMPLE_RATE, subtype="PCM_16", format="WAV")


# ---- main --------------------------------------------------------------------------------------------------


def make_samples(out: Path = SAMPLES_DIR) -> list[Path]:
    """Write sample.png, sample.mp4 and sample.wav into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sample.png", out / "sample.mp4", out / "sample.wav"]
    draw_scene().save(paths[0], format="PNG", optimize=True)
    write_mp4(paths[1], video_frames())
    write_wav(paths[2], synthesize_speech())
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SAMPLES_DIR, help=f"directory (default {SAMPLES_DIR})")
    args = parser.parse_args(argv)
    for path in make_samples(args.out):
        print(f"{path}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
