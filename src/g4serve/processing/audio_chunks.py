"""Long audio cut into clips the audio tower can hear (at most ``max_audio_seconds`` each) for
transcription: each cut lands in the quietest short window near its clip's end, so a pause takes the cut,
not the middle of a word (the idea of vLLM's speech-to-text ``_split_audio``)."""

from __future__ import annotations

from typing import Any

import numpy as np

# Where a cut may go: the last SEARCH_S seconds before the limit. Energy is measured over WINDOW_S
# (100 ms: shorter than a word, longer than the gap between two phonemes), every HOP_S.
SEARCH_S = 2.0
WINDOW_S = 0.1
HOP_S = 0.01


def chunk_bounds(
    waveform: Any,
    max_samples: int,
    search_samples: int,
    window_samples: int,
    hop_samples: int = 1,
) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: sample ranges that tile ``waveform`` (1-D numpy array or torch tensor) in
    order, each at most ``max_samples`` long and, where it has to be cut, at least ``window_samples``.

    A waveform of at most ``max_samples`` is one range (none when it is empty). A longer one is cut at the
    middle of the quietest ``window_samples`` window (lowest mean square) centred within the last
    ``search_samples`` before each limit, tried every ``hop_samples``; when several windows are equally
    quiet (a silent gap), the cut goes to the middle of the latest such run, so a pause is cut in its
    middle and pure silence near the limit."""
    sizes_fit = 1 <= window_samples <= search_samples < max_samples and 2 * window_samples <= max_samples
    if not sizes_fit or hop_samples < 1:
        raise ValueError(
            "chunk sizes: need 1 <= window_samples <= search_samples < max_samples, 2 * window_samples <= "
            f"max_samples and hop_samples >= 1, got window {window_samples}, search {search_samples}, max "
            f"{max_samples}, hop {hop_samples}"
        )
    if hasattr(waveform, "detach"):  # a torch tensor
        waveform = waveform.detach().cpu().numpy()
    wave = np.asarray(waveform)
    if wave.ndim != 1:
        raise ValueError(f"waveform: must be 1-D, got shape {wave.shape}")
    total = len(wave)
    bounds: list[tuple[int, int]] = []
    start = 0
    while total - start > max_samples:
        # Centres such that both sides of the cut are at least a window long (the rest of the audio too)
        # and the window around the centre lies inside the waveform.
        lowest = start + max(window_samples, max_samples - search_samples)
        highest = min(start + max_samples, total - window_samples)
        cut = _quietest_centre(wave, lowest, highest, window_samples, hop_samples)
        assert start < cut <= start + max_samples and total - cut >= window_samples
        bounds.append((start, cut))
        start = cut
    if total > start:
        bounds.append((start, total))
    return bounds


def _quietest_centre(wave: np.ndarray, lowest: int, highest: int, window: int, hop: int) -> int:
    """The centre in ``[lowest, highest]`` (stepping back from ``highest`` by ``hop``) of the window with
    the least energy; ties go to the middle of the latest run of them."""
    centres = np.arange(highest, lowest - 1, -hop)  # latest first: argmin finds the latest minimum
    half = window // 2
    first = int(centres[-1]) - half
    region = wave[first : int(centres[0]) - half + window].astype(np.float64)
    energy = np.concatenate(([0.0], np.cumsum(region * region)))
    starts = centres - half - first
    # Sums of squares from a running total: an exactly silent window gives exactly 0, and equal windows of
    # real audio differ by rounding only. A NaN or inf sample in reach leaves the cut at the limit.
    with np.errstate(invalid="ignore", over="ignore"):
        power = energy[starts + window] - energy[starts]
        quiet = power <= power.min() + 1e-9 * max(float(power.max()), 1e-12)
    at = int(np.argmax(quiet))
    run = int(np.argmin(quiet[at:])) if not quiet[at:].all() else len(quiet) - at
    return int(centres[at + run // 2])


def speech_chunk_bounds(waveform: Any, max_samples: int, sample_rate: int) -> list[tuple[int, int]]:
    """``chunk_bounds`` with the transcription defaults (``SEARCH_S``, ``WINDOW_S``, ``HOP_S``), scaled
    down for a ``max_samples`` under a few seconds."""
    if max_samples < 2:
        raise ValueError(f"max_samples: must be at least 2, got {max_samples}")
    search = max(1, min(round(SEARCH_S * sample_rate), max_samples // 2))
    window = max(1, min(round(WINDOW_S * sample_rate), search // 2))
    hop = max(1, min(round(HOP_S * sample_rate), window))
    return chunk_bounds(waveform, max_samples, search, window, hop)


__all__ = ["HOP_S", "SEARCH_S", "WINDOW_S", "chunk_bounds", "speech_chunk_bounds"]
