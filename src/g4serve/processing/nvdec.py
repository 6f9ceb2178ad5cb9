"""Container videos decoded by the GPU's video engines (NVDEC) with ``--video-decoder nvdec``.

PyAV demuxes, exactly as on the host path: the video's bytes in memory, the allowed demuxers only, no
protocols, and the header checked by the same functions (``video.check_video_header``). A bitstream filter
turns the H.264 or HEVC packets into Annex B, and an NVDEC decoder (NVIDIA's PyNvVideoCodec) decodes them on
the engine's GPU, on the preparing thread's side stream. Every frame that comes out counts against the same
caps as the host's (``video.check_decoded_frame``), decoding stops once the last sampled frame is out, and
only the sampled frames are converted from NV12 to RGB, in torch: the video then goes through
``preprocess_video``'s float resize and patchify on the device like nvJPEG-decoded frames.

Numerics: H.264 and HEVC decoding is exact, so NVDEC's YUV equals FFmpeg's; the colour conversion is the
one the host's ``to_ndarray("rgb24")`` applies (swscale: BT.709 for streams tagged so, BT.601 otherwise;
limited range unless tagged full), in float with one rounding, where swscale uses fixed-point tables: within
a few levels of the host's pixels (tests/processing/test_nvdec.py). NVDEC's own RGB output converts every
frame with BT.709 whatever the stream says (6.9 levels from the host's on an untagged clip, on an H100).

What it takes: H.264 and HEVC in 8-bit 4:2:0, even frame sizes up to ``max_frame_pixels`` (1080p), the
colour spaces above, a frame count in the header (for the sampling; a stream without one is counted by the
host path). Anything else, and anything NVDEC or PyNvVideoCodec reports, goes to the host path, which decodes
it or names what is wrong. A limit a frame passes is refused here with the host path's own error.

Decoders: one per thread and codec, kept for the next video of the same size (making one took ~160 ms on
an H100) and flushed after every video, so nothing of one request's video can come out in another's. Each
holds up to ``DECODER_SURFACES`` frames of its size on the device (``memory_bound``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import av
import av.bitstream
import numpy as np
import torch

from g4serve.processing.limits import MediaBudget, MediaLimits
from g4serve.processing.video import (
    VideoFrames,
    check_decoded_frame,
    check_video_header,
    open_video,
    sample_frame_indices,
    video_frames_at,
)

log = logging.getLogger(__name__)

# codec -> (PyNvVideoCodec's cudaVideoCodec name, the bitstream filter that makes its packets Annex B)
CODECS = {"h264": ("H264", "h264_mp4toannexb"), "hevc": ("HEVC", "hevc_mp4toannexb")}
# FFmpeg's AVColorSpace values swscale (so the host path) converts with BT.709, and those it converts with
# BT.601 (unspecified among them); any other goes to the host path.
BT709 = {1}
BT601 = {2, 5, 6}
FULL_RANGE = 2  # AVCOL_RANGE_JPEG
KR_KB = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}
MAX_FRAME_PIXELS = 2048 * 1088  # 1080p and 2K, not 4K: a decoder's surfaces are sized by its frames
# Frames a decoder may hold on the device: H.264's DPB (16) + the parser's extra surfaces + output frames.
DECODER_SURFACES = 24


def memory_bound(threads: int, max_frame_pixels: int = MAX_FRAME_PIXELS) -> int:
    """Bytes the decoders of ``threads`` preparing threads may hold (NV12, one codec each)."""
    return threads * DECODER_SURFACES * max_frame_pixels * 3 // 2


def nv12_to_rgb(
    nv12: torch.Tensor, height: int, matrix: str = "bt601", full_range: bool = False
) -> torch.Tensor:
    """uint8 [H, W, 3] RGB from an NV12 frame [H * 3 / 2, W] (luma rows, then interleaved U/V rows at half
    resolution), each chroma sample used for its 2 x 2 pixels, as swscale's unscaled conversion does."""
    kr, kb = KR_KB[matrix]
    kg = 1.0 - kr - kb
    y = nv12[:height].float()
    uv = nv12[height:].view(height // 2, -1, 2).float() - 128.0
    uv = uv.repeat_interleave(2, 0).repeat_interleave(2, 1)
    u, v = uv[..., 0], uv[..., 1]
    luma, chroma = (1.0, 1.0) if full_range else (255.0 / 219.0, 255.0 / 224.0)
    if not full_range:
        y = y - 16.0
    y = y * luma
    rgb = torch.stack(
        [
            y + 2.0 * (1.0 - kr) * chroma * v,
            y - (2.0 * kb * (1.0 - kb) / kg) * chroma * u - (2.0 * kr * (1.0 - kr) / kg) * chroma * v,
            y + 2.0 * (1.0 - kb) * chroma * u,
        ],
        dim=-1,
    )
    return rgb.round_().clamp_(0, 255).to(torch.uint8)


class NvdecUnavailable(ValueError):
    """PyNvVideoCodec is not installed, or the driver's NVDEC library does not load: the option cannot be
    served here (a ValueError, so ``g4serve serve`` names it and exits instead of printing a traceback)."""


class _Refused(Exception):
    """This video goes to the host path (not an error of the request)."""


def import_pynvvideocodec() -> Any:
    try:
        ctypes.CDLL("libnvcuvid.so.1")
    except OSError as exc:
        raise NvdecUnavailable(
            f"--video-decoder nvdec: the driver's NVDEC library does not load ({exc})"
        ) from None
    try:
        import PyNvVideoCodec  # noqa: N813 - the package's own name
    except Exception as exc:  # noqa: BLE001 - not installed, or its libraries do not load
        raise NvdecUnavailable(
            f"--video-decoder nvdec needs NVIDIA's PyNvVideoCodec (pip install pynvvideocodec): {exc}"
        ) from None
    return PyNvVideoCodec


def _current_context() -> int:
    """The calling thread's current CUDA context (the driver's ``CUcontext``; 0 if none)."""
    context = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(context))
    return context.value or 0


@dataclass
class _Decoder:
    handle: Any
    width: int
    height: int
    stream: int  # the CUDA stream it copies frames on


class _DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as a CUDA array (what torch.as_tensor reads without a copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class NvdecVideos:
    """Decodes a container video's sampled frames with NVDEC into uint8 RGB on ``device``.

    ``nvc``: the PyNvVideoCodec module (default: imported, ``NvdecUnavailable`` where it cannot be); tests
    hand in a stand-in with the same interface on the CPU, whose frames are host memory."""

    def __init__(self, device: torch.device | str, nvc: Any = None, max_frame_pixels: int = MAX_FRAME_PIXELS):
        self.device = torch.device(device)
        self.nvc = nvc if nvc is not None else import_pynvvideocodec()
        self.max_frame_pixels = max_frame_pixels
        self._local = threading.local()

    def load(
        self,
        data: bytes,
        limits: MediaLimits,
        num_frames: int,
        budget: MediaBudget | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> VideoFrames | None:
        """The sampled frames (``video.load_video``'s, as a uint8 [F, H, W, 3] tensor on the device), or None:
        the host path decodes this video. A cap the video passes raises the host path's ``ValueError``.
        ``reserve(pixels)`` is called with the kept frames' pixels before anything is decoded."""
        with open_video(data, limits) as container:
            if not container.streams.video:
                return None  # the host path answers "no video stream"
            stream = container.streams.video[0]
            plan = self._plan(stream)
            if plan is None:
                return None
            indices = sample_frame_indices(stream.frames, num_frames)
            check_video_header(stream, set(indices), limits, budget)
            width, height = stream.codec_context.width, stream.codec_context.height
            if reserve is not None:
                reserve(len(indices) * width * height)
            rate = stream.average_rate
            try:
                picked = self._decode(container, stream, plan, indices, limits, budget)
            except _Refused as why:
                log.debug("NVDEC left a video to the host path: %s", why)
                return None
        frames = torch.stack([picked[i] for i in indices])
        if budget is not None:
            budget.charge_pixels(frames.shape[0] * frames.shape[1] * frames.shape[2])
        return video_frames_at(frames, indices, float(rate) if rate else None)

    def _plan(self, stream: Any) -> tuple[str, str, str, bool] | None:
        """(codec, bitstream filter, colour matrix, full range) of a stream NVDEC takes; None: the host's."""
        ctx = stream.codec_context
        if ctx is None or ctx.name not in CODECS or ctx.pix_fmt not in ("yuv420p", "yuvj420p"):
            return None
        if (
            ctx.width % 2
            or ctx.height % 2
            or ctx.width * ctx.height > self.max_frame_pixels
            or stream.frames <= 0
        ):
            return None
        if ctx.colorspace in BT709:
            matrix = "bt709"
        elif ctx.colorspace in BT601:
            matrix = "bt601"
        else:
            return None
        codec, bsf = CODECS[ctx.name]
        full = ctx.color_range == FULL_RANGE or ctx.pix_fmt == "yuvj420p"
        return codec, bsf, matrix, full

    def _decoder(self, codec: str, width: int, height: int) -> Any:
        """This thread's decoder for ``codec`` at this frame size on the current stream (made if need be)."""
        held: dict[str, _Decoder] = self._local.__dict__.setdefault("decoders", {})
        stream, context = 0, 0
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device).cuda_stream
            context = _current_context()  # torch's (the primary) context: the stream's
        entry = held.get(codec)
        if entry is not None and (entry.width, entry.height, entry.stream) == (width, height, stream):
            return entry.handle
        held.pop(codec, None)  # another size: a decoder of this one (its surfaces are sized at creation)
        try:
            handle = self.nvc.CreateDecoder(
                gpuid=self.device.index or 0,
                codec=getattr(self.nvc.cudaVideoCodec, codec),
                cudacontext=context,
                cudastream=stream,
                usedevicememory=True,
                maxwidth=width,
                maxheight=height,
            )
        except Exception as exc:  # noqa: BLE001 - the session limit, an unsupported profile: the host decodes
            raise _Refused(f"no decoder: {exc}") from None
        held[codec] = _Decoder(handle, width, height, stream)
        return handle

    def _packet(self, data: av.Packet | None) -> Any:
        """PyNvVideoCodec's packet over ``data``'s buffer (kept alive by the caller); None: end of stream."""
        packet = self.nvc.PacketData()
        if data is not None:
            packet.bsl_data, packet.bsl = data.buffer_ptr, data.size
            packet.pts = data.pts if data.pts is not None else 0
        return packet

    def _decode(
        self,
        container: Any,
        stream: Any,
        plan: tuple[str, str, str, bool],
        indices: list[int],
        limits: MediaLimits,
        budget: MediaBudget | None,
    ) -> dict[int, torch.Tensor]:
        codec, bsf_name, matrix, full = plan
        width, height = stream.codec_context.width, stream.codec_context.height
        decoder = self._decoder(codec, width, height)
        wanted, last = set(indices), max(indices)
        picked: dict[int, torch.Tensor] = {}
        seen = [0, 0]  # frames out, their pixels

        def take(frames: Any) -> None:
            for frame in frames:
                count = seen[0]
                seen[0] += 1
                seen[1] += width * height
                check_decoded_frame(width, height, seen[0], seen[1], limits)
                if count in wanted:
                    if budget is not None:
                        budget.check_pixels((len(picked) + 1) * width * height)
                    picked[count] = nv12_to_rgb(self._nv12(frame, width, height), height, matrix, full)

        ended = False
        try:
            ended = self._feed(container, stream, bsf_name, decoder, take, lambda: seen[0] > last)
        finally:
            if not ended:
                self._flush(codec, decoder)
        if len(picked) < len(indices):
            raise _Refused(f"{seen[0]} frames decoded, the header said {stream.frames}")
        return picked

    def _feed(
        self, container: Any, stream: Any, bsf_name: str, decoder: Any, take: Callable, done: Callable
    ) -> bool:
        """Demux ``stream`` into the decoder as Annex B, its frames to ``take``, until ``done()`` or the
        stream's end; whether the end was reached (what the decoder held then came out)."""
        try:
            bsf = av.bitstream.BitStreamFilterContext(bsf_name, stream)
            for packet in container.demux(stream):
                for annexb in bsf.filter(packet if packet.size else None):
                    take(self._call(decoder.Decode, self._packet(annexb)))
                if done():
                    return False
        except av.FFmpegError as exc:
            raise _Refused(f"demuxing: {exc}") from None
        take(self._call(decoder.Decode, self._packet(None)))
        return True

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - PyNvVideoCodec's errors: the host path decodes (or names it)
            raise _Refused(f"NVDEC: {exc}") from None

    def _flush(self, codec: str, decoder: Any) -> None:
        """End the stream in the decoder, dropping what it still holds, so the next video starts clean; a
        decoder that fails to is dropped."""
        try:
            decoder.Decode(self._packet(None))
        except Exception:  # noqa: BLE001 - not reused
            self._local.__dict__.get("decoders", {}).pop(codec, None)

    def _nv12(self, frame: Any, width: int, height: int) -> torch.Tensor:
        """The decoded frame's NV12 bytes as [H * 3 / 2, W] (read in place: converted before the next
        ``Decode``, on the stream the decoder copies on)."""
        nbytes = width * height * 3 // 2
        if frame.framesize() != nbytes:
            raise _Refused(f"a frame of {frame.framesize()} bytes, {width}x{height} expected")
        ptr = frame.GetPtrToPlane(0)
        if self.device.type == "cuda":
            flat = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=self.device)
        else:
            flat = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))
        return flat.view(height * 3 // 2, width)
