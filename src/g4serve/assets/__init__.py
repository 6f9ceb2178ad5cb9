"""Small sample media shipped with the package, for the demo, the docs and the tests.

``sample_path("sample.png")`` finds a file in ``assets/samples/`` whether g4serve runs from a clone or from an
installed wheel. The files are written by ``make_samples.py`` beside this module (see its docstring).
"""

from __future__ import annotations

from pathlib import Path

SAMPLES_DIR = Path(__file__).parent / "samples"
# What make_samples.py writes; the names the demo, the docs and the tests use.
SAMPLE_NAMES = ("sample.png", "sample.mp4", "sample.wav")


def sample_path(name: str) -> Path:
    """The path of the shipped sample ``name`` (one of ``SAMPLE_NAMES``); raises if it is not there."""
    path = SAMPLES_DIR / name
    if name not in SAMPLE_NAMES or not path.is_file():
        # Name the choices: a typo ("sample.jpg") should not read as a broken install.
        raise FileNotFoundError(f"no sample {name!r} in {SAMPLES_DIR} (samples: {', '.join(SAMPLE_NAMES)})")
    return path


__all__ = ["SAMPLES_DIR", "SAMPLE_NAMES", "sample_path"]
