"""Cutting long audio into clips the audio tower hears whole (``processing/audio_chunks.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from g4serve.processing.audio_chunks import chunk_bounds, speech_chunk_bounds

RATE = 16_000
LIMIT = 30 * RATE
SEARCH, WINDOW, HOP = 2 * RATE, RATE // 10, RATE // 100


def _speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Loud noise with a syllable-like envelope: no window of it is anywhere near silent."""
    rng = np.random.default_rng(seed)
    n = round(seconds * RATE)
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4 * np.arange(n) / RATE)
    return (0.3 * envelope * rng.standard_normal(n)).astype(np.float32)


def _check_tiling(bounds, total: int, max_samples: int, window: int) -> None:
    """Contiguous ranges covering [0, total) exactly, none empty or over the limit; a cut never leaves a
    clip shorter than one energy window."""
    if total == 0:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start
    for start, end in bounds:
        assert 0 < end - start <= max_samples
        if len(bounds) > 1:
            assert end - start >= window


def test_the_cut_lands_in_a_quiet_gap_inside_the_search_window():
    wave = _speech(45.0)
    gap = (round(28.6 * RATE), round(28.9 * RATE))  # a 300 ms pause 1.1-1.4 s before the limit
    wave[gap[0] : gap[1]] = 0.001 * np.random.default_rng(1).standard_normal(gap[1] - gap[0])
    bounds = chunk_bounds(wave, LIMIT, SEARCH, WINDOW, HOP)
    _check_tiling(bounds, len(wave), LIMIT, WINDOW)
    [(_, cut), _] = bounds
    # The whole 100 ms energy window around the cut lies in the pause: no word is cut.
    assert gap[0] + WINDOW // 2 <= cut <= gap[1] - WINDOW // 2


def test_a_silent_gap_is_cut_in_its_middle_and_a_gap_outside_the_window_is_ignored():
    wave = _speech(50.0)
    wave[20 * RATE : 21 * RATE] = 0.0  # quieter, but 9 s before the limit: out of reach
    wave[round(28.5 * RATE) : 29 * RATE] = 0.0
    [(_, cut), _] = chunk_bounds(wave, LIMIT, SEARCH, WINDOW, HOP)
    assert abs(cut - round(28.75 * RATE)) <= HOP
    # Of two pauses in reach, the quieter one takes the cut.
    wave = _speech(50.0)
    wave[round(28.2 * RATE) : round(28.5 * RATE)] *= 0.01
    wave[round(29.2 * RATE) : round(29.5 * RATE)] *= 0.1
    [(_, cut), _] = chunk_bounds(wave, LIMIT, SEARCH, WINDOW, HOP)
    assert round(28.2 * RATE) <= cut <= round(28.5 * RATE)


def test_the_clips_tile_the_waveform_for_many_lengths_and_sizes():
    rng = np.random.default_rng(2)
    for total in [0, 1, 2, 9, 10, 11, 19, 20, 21, 99, 100, 101, 257, 1000, 4097]:
        for max_samples, search, window, hop in [(10, 4, 2, 1), (10, 9, 5, 3), (2, 1, 1, 1), (64, 16, 8, 4)]:
            for wave in (rng.standard_normal(total), np.zeros(total), np.ones(total)):
                bounds = chunk_bounds(wave, max_samples, search, window, hop)
                _check_tiling(bounds, total, max_samples, window)
                # No more clips than needed with cuts in the last `search` samples before each limit.
                if total > max_samples:
                    assert len(bounds) <= -(-total // (max_samples - search)) + 1


def test_short_audio_is_one_clip_and_the_limit_is_inclusive():
    assert chunk_bounds(np.zeros(0), LIMIT, SEARCH, WINDOW) == []
    assert chunk_bounds(_speech(1.0), LIMIT, SEARCH, WINDOW) == [(0, RATE)]
    assert chunk_bounds(np.zeros(1), LIMIT, SEARCH, WINDOW) == [(0, 1)]
    assert chunk_bounds(_speech(30.0), LIMIT, SEARCH, WINDOW, HOP) == [(0, LIMIT)]
    # One sample over: two clips, the second no shorter than an energy window.
    over = chunk_bounds(_speech(30.0 + 1 / RATE), LIMIT, SEARCH, WINDOW, HOP)
    _check_tiling(over, LIMIT + 1, LIMIT, WINDOW)
    assert len(over) == 2 and over[1][1] - over[1][0] >= WINDOW


def test_pure_silence_and_pure_noise():
    for wave in (np.zeros(95 * RATE, np.float32), _speech(95.0, seed=3)):
        bounds = chunk_bounds(wave, LIMIT, SEARCH, WINDOW, HOP)
        _check_tiling(bounds, len(wave), LIMIT, WINDOW)
        assert len(bounds) == 4
        for start, end in bounds[:-1]:
            assert end - start >= LIMIT - SEARCH  # cut inside the search window
    # Silence everywhere: every window ties, the cut goes to the middle of the search window.
    [(_, cut), *_] = chunk_bounds(np.zeros(95 * RATE), LIMIT, SEARCH, WINDOW, HOP)
    assert abs(cut - (LIMIT - SEARCH // 2)) <= HOP


def test_odd_values_and_inputs():
    wave = _speech(40.0)
    assert chunk_bounds(torch.from_numpy(wave), LIMIT, SEARCH, WINDOW, HOP) == chunk_bounds(
        wave, LIMIT, SEARCH, WINDOW, HOP
    )
    wave[5 * RATE] = np.nan
    wave[29 * RATE] = np.inf
    _check_tiling(chunk_bounds(wave, LIMIT, SEARCH, WINDOW, HOP), len(wave), LIMIT, WINDOW)
    loud = np.full(70 * RATE, 3e38, np.float32)  # squares overflow float32: summed in float64
    _check_tiling(chunk_bounds(loud, LIMIT, SEARCH, WINDOW, HOP), len(loud), LIMIT, WINDOW)
    with pytest.raises(ValueError, match="1-D"):
        chunk_bounds(np.zeros((2, 100)), 10, 4, 2)
    for sizes in [(10, 10, 2), (10, 4, 5), (10, 4, 0), (10, 0, 0), (10, 9, 6)]:
        with pytest.raises(ValueError, match="chunk sizes"):
            chunk_bounds(np.zeros(100), *sizes)
    with pytest.raises(ValueError, match="chunk sizes"):
        chunk_bounds(np.zeros(100), 10, 4, 2, hop_samples=0)


def test_the_transcription_defaults():
    bounds = speech_chunk_bounds(_speech(70.0), LIMIT, RATE)
    _check_tiling(bounds, 70 * RATE, LIMIT, WINDOW)
    assert len(bounds) == 3 and all(end - start >= 28 * RATE for start, end in bounds[:2])
    # Limits of a few samples still tile (an operator's --max-audio-seconds of a millisecond).
    for max_samples in (2, 3, 16, 100):
        _check_tiling(speech_chunk_bounds(np.ones(1000), max_samples, RATE), 1000, max_samples, 1)
    with pytest.raises(ValueError, match="max_samples"):
        speech_chunk_bounds(np.ones(10), 1, RATE)
