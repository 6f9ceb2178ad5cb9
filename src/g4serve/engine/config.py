"""``EngineConfig``: every engine option, its one default and its help text.

A default written anywhere else would drift from this one: the scheduler reads its limits from this object,
and ``g4serve.engine_args`` makes the CLI flags of ``g4serve serve``, ``g4serve generate``, the bench and the
assistant from these fields (their metadata: ``help``; ``cli=False``: no flag; ``choices``; ``parse``: a
parser named in ``engine_args.PARSERS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from g4serve.processing.limits import MediaLimits
from g4serve.quant_config import QUANTIZATION_PRESETS

MODALITIES = ("image", "video", "audio")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # layers.attention.BACKENDS, plus auto
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3 (engine.kv_cache.tensors)
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's names (engine.scheduler.ORDER_KEYS)


def _opt(default: Any = None, help: str = "", **meta: Any) -> Any:
    """A config field: its default, its flag's help text, and flag options."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


VIDEO_DECODERS = ("host", "nvdec")
# Threads that prepare requests (tokenize, decode and resize media) beside the engine thread (AsyncLLMEngine).
PREPROCESS_WORKERS = 4


@dataclass
class EngineConfig:
    model: str | None = _opt(None, "checkpoint directory or preset; None: the embedded tiny model", cli=False)
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's)")
    device: str = _opt("auto", "cpu, cuda, cuda:1, ... (auto: cuda if available)")
    dtype: str = _opt("auto", "auto, float32, bfloat16, float16 (auto: bfloat16 on CUDA, float32 on CPU)")
    # Dense weights (a random preset or a bf16 checkpoint) quantized at load by g4serve's own quantizer
    # (layers/quant.py); a compressed-tensors checkpoint (FP8, int4 w4a16) is served quantized without it.
    quantization: str | None = _opt(
        None,
        "quantize the dense weights at load: fp8 (per-channel FP8, per-token activations), fp8-block "
        "(128x128 blocks), w4a16 (int4, groups of 128), w4a16-g32 (groups of 32); not needed for "
        "compressed-tensors checkpoints",
        choices=tuple(QUANTIZATION_PRESETS),
    )
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens (default: the model's)")
    max_num_seqs: int = _opt(64, "sequences in one step")
    # A request's ``priority`` orders the queue and picks who is preempted, so honouring it lets any client
    # jump the queue and evict everyone else's KV: only an operator who trusts its clients turns it on
    # (vLLM's flag and names). Under fcfs a request that sets one is refused rather than silently reordered.
    scheduling_policy: str = _opt(
        "fcfs",
        "fcfs: requests run in arrival order and one that sets a priority is refused (400); priority: "
        "a request's priority (lower first, then arrival) orders admission and picks preemption victims",
        choices=SCHEDULING_POLICIES,
    )
    # None: default_token_budget of the device's type, resolved at construction.
    max_num_batched_tokens: int | None = _opt(
        None,
        "tokens in one step: decodes plus prefill chunks (default: 8192 on CUDA, 2048 on CPU)",
    )
    # engine/scheduler.py: with decodes running, a step's prefill chunks share at most this many tokens, so a
    # long prompt or a video's soft tokens lengthen the decodes' step by a bounded amount (the ITL side of the
    # budget); a step without decodes still gets max_num_batched_tokens. SGLang's --chunked-prefill-size
    # caps every step; this caps only the steps that carry decodes.
    max_prefill_tokens_beside_decodes: int | None = _opt(
        None,
        "with decodes in a step, its prefill chunks get at most this many tokens (bounds the decodes' step "
        "time under prompt and media load; default: the whole token budget)",
    )
    max_encoder_tokens_beside_decodes: int | None = _opt(
        None,
        "with decodes in a step, its media encodes produce at most this many soft tokens; a video encodes "
        "the frames that fit (at least one) and its prefill follows frame by frame (bounds the decodes' "
        "step time under video load; default: the whole encoder budget)",
    )
    block_size: int = _opt(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = _opt(
        0.9, "share of the GPU's memory the engine may use, KV cache included"
    )
    # Explicit KV budget; on CPU without it the engine takes 256 MiB.
    kv_cache_bytes: int | None = _opt(None, "explicit KV-cache budget in bytes (CPU default 256 MiB)")
    # FP8 stores each K/V value in one byte, divided by a per-(layer, KV head) scale: the checkpoint's
    # k_scale / v_scale where it has them, else 1.0 (Gemma 4 RMS-normalises K and V before the cache).
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3, one byte a value: "
        "about twice the tokens of bf16 in the same memory)",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of prompt prefixes seen before")
    fast_prefill: bool = _opt(
        True, "skip the KV-shared layers for prompt tokens whose logits are not needed (E2B/E4B)"
    )
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps beside the decodes")
    encoder_cache_tokens: int = _opt(16384, "soft tokens of encoded media kept for reuse")
    encoder_token_budget: int = _opt(4096, "soft tokens the media encoders may produce in one step")
    mm_processor_cache_gb: float = _opt(
        1.0,
        "GiB of host memory keeping processed media items by their encoded bytes, so an image or video "
        "sent again (each turn of a chat) skips decoding and resizing (0: off)",
    )
    limit_mm_per_prompt: dict[str, int] = _opt(
        {"image": 32, "video": 4, "audio": 8},
        'media per prompt, e.g. \'{"image": 4, "video": 1}\' or image=4,video=1; all 0 = text-only',
        parse="mm_limits",
    )
    # Caps on decoding a request's media (processing.limits.MediaLimits holds the rest of them).
    max_media_bytes: int = _opt(
        512 << 20, "encoded media bytes one request may carry (data: URLs, files, frames)"
    )
    max_media_pixels: int = _opt(8192 * 8192, "pixels of one decoded image or video frame")
    max_request_pixels: int = _opt(
        MediaLimits.max_request_pixels,
        "decoded pixels one request keeps: its images plus the sampled frames of its videos",
    )
    max_video_frames: int = _opt(9000, "frames one video (or list of frames) may have")
    max_audio_seconds: float = _opt(
        30.0, "seconds of each audio clip decoded; the rest is dropped (the model hears 30)"
    )
    # processing/device_media.py. nvJPEG and a float32 resize (what transformers' processor computes with
    # device="cuda") put pixels near the host path's, which matches its CPU processor bit for bit. None: on
    # for a CUDA engine that serves media (served on an H200, 6 x 480p videos at 32 QPS: TTFT p50 / p95
    # 32.4 / 69.7 ms against 54.0 / 127.4 on the host; audio clips at 4 QPS 36.7 / 51.3 against 60.7 / 99.1).
    media_on_gpu: bool | None = _opt(
        None,
        "prepare media on the GPU: JPEGs decoded by nvJPEG, images and frames resized and cut into patches "
        "there, audio's log-mel features computed there (near, not equal to, the host path, which matches "
        "transformers exactly) (default: on for a CUDA engine that serves media)",
    )
    # processing/nvdec.py. On an H100 one 10 s 480p H.264 video took 174 ms on NVDEC against 111 on 16 host
    # cores; four at once, NVDEC served 1.5x the videos a second for a tenth of the host CPU
    # (docs/benchmarks.md). Off by default.
    video_decoder: str = _opt(
        "host",
        "host: container videos decoded by FFmpeg on the CPU; nvdec: H.264/HEVC decoded by the GPU's NVDEC "
        "(needs media on the GPU and NVIDIA's PyNvVideoCodec; other videos still decode on the host)",
        choices=VIDEO_DECODERS,
    )
    text_only: bool = _opt(False, "do not load the vision/audio towers")
    strict_config: bool = _opt(True, "reject config.json keys g4serve does not know", cli=False)
    seed: int = _opt(0, "seed of random preset weights")
    attention_backend: str = _opt(
        "auto",
        "auto: Triton kernels on CUDA, the PyTorch reference elsewhere",
        choices=ATTENTION_BACKENDS,
    )
    # On CUDA with the Triton backend, decode, prefill/mixed and vision-encoder steps replay CUDA graphs
    # unless this is set (vLLM's --enforce-eager).
    enforce_eager: bool = _opt(False, "run every step eagerly (default on CUDA: captured CUDA graphs)")
    max_cuda_graph_batch: int | None = _opt(
        None, "largest decode batch replayed as a CUDA graph (default: max-num-seqs)"
    )
    # Schedule and launch step N+1 before reading step N's samples back (vLLM's --async-scheduling): the
    # host's scheduling, input packing and output processing (0.3-2 ms a step on an H100 host) then
    # overlap the device's work. Requests stopped by a token or string compute one extra, discarded token.
    async_scheduling: bool = _opt(
        True,
        "launch each step before the previous step's tokens are read back (a stopped request "
        "computes one discarded token)",
    )
    # Constrained requests take the text their grammar forces (JSON keys and punctuation, the rest of an enum
    # value once its prefix is unique) as output tokens at once; the next step computes them in one forward,
    # as a chunk, instead of one decode step each. Off by default: outputs stay valid, but their tokens are
    # the tokenizer's spelling of the forced text, not necessarily the ones the model would have sampled, so
    # outputs can differ from decoding without it (docs/api.md, "Jump-forward decoding").
    jump_forward: bool = _opt(
        False,
        "structured output: append the text the grammar forces in one step instead of decoding it token by "
        "token (requests asking for logprobs decode every token)",
    )
    # Encode media ahead of the prefills that need them, on a side CUDA stream, while other requests'
    # steps keep running (without it, a step with new media runs its encoder first and stalls its decodes).
    overlap_encoder: bool = _opt(
        False, "encode images, video and audio ahead of the prefills that need them, on a side CUDA stream"
    )

    # Tensor parallel (engine/tensor_parallel.py): one process per rank, rank 0 the engine; GPUs cuda:0..N-1
    # (after the one --device names), or N processes on the CPU (gloo).
    tensor_parallel_size: int = _opt(
        1,
        "split the decoder over N GPUs (one process each): heads, MLP units, experts' units and the "
        "vocabulary; the KV cache by KV head",
    )
    enable_expert_parallel: bool = _opt(
        False, "with --tensor-parallel-size: split the routed experts by expert (whole experts per GPU)"
    )

    # LoRA adapters (PEFT format) on the text decoder's projections; the request's ``model`` names one.
    enable_lora: bool = _opt(False, "serve LoRA adapters (implied by --lora-modules)")
    lora_modules: dict[str, str] = _opt(
        {},
        "adapters loaded at start: name=path (repeatable, or several after one flag) or JSON "
        '\'{"name": "sql", "path": "/adapters/sql"}\'',
        parse="lora_modules",
        nargs="+",
    )
    max_loras: int = _opt(4, "LoRA adapters loaded at once (each holds a slot of device memory)")
    max_lora_rank: int = _opt(16, "largest LoRA rank an adapter may have (slots are sized for it)")
    # Speculative decoding (engine/speculative.py): vLLM's JSON, e.g. '{"method": "ngram",
    # "num_speculative_tokens": 3}' or '{"method": "mtp", "model": "/gemma-4-E4B-it-assistant"}'.
    speculative_config: dict | None = _opt(
        None,
        'speculative decoding as JSON: {"method": "ngram" | "mtp", "num_speculative_tokens": k, '
        '"model": MTP drafter directory, "prompt_lookup_max": n, "prompt_lookup_min": n}',
        parse="json_object",
    )

    def __post_init__(self) -> None:
        self._check_lora()
        if self.text_only:
            self.limit_mm_per_prompt = {"image": 0, "video": 0, "audio": 0}
        self._check_steps()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: expected auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if not 0 <= self.mm_processor_cache_gb < 1 << 20:
            raise ValueError(f"mm_processor_cache_gb: must be 0 or more, got {self.mm_processor_cache_gb!r}")
        if self.media_on_gpu is None:
            self.media_on_gpu = device_type(self.device) == "cuda" and not self.text_only
        if self.media_on_gpu and device_type(self.device) != "cuda":
            raise ValueError(f"media_on_gpu: needs a CUDA device, the engine runs on {self.device!r}")
        if self.video_decoder not in VIDEO_DECODERS:
            raise ValueError(f"video_decoder: expected host or nvdec, got {self.video_decoder!r}")
        if self.video_decoder == "nvdec" and not self.media_on_gpu:
            raise ValueError("video_decoder: nvdec needs media prepared on the GPU (media_on_gpu)")
        self._check_tensor_parallel()

    def _check_steps(self) -> None:
        """The step's shape: block size, sequence cap, token budget (its device default) and prefill cap."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_token_budget(device_type(self.device))
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        self._check_beside_decodes()

    def _check_beside_decodes(self) -> None:
        """The caps on a step's prefill and encodes once it holds decodes."""
        if self.max_encoder_tokens_beside_decodes is not None:
            if self.max_encoder_tokens_beside_decodes <= 0:
                raise ValueError("max_encoder_tokens_beside_decodes: must be positive")
            if self.overlap_encoder:
                raise ValueError(
                    "max_encoder_tokens_beside_decodes: bounds the encodes inside a step; with "
                    "overlap_encoder they run on a side stream (pick one)"
                )
        if self.max_prefill_tokens_beside_decodes is not None:
            if self.max_prefill_tokens_beside_decodes <= 0:
                raise ValueError("max_prefill_tokens_beside_decodes: must be positive")
            if not self.enable_chunked_prefill:
                raise ValueError(
                    "max_prefill_tokens_beside_decodes: needs chunked prefill (a prompt is split to fit)"
                )

    def _check_tensor_parallel(self) -> None:
        """What tensor parallel does not combine with yet is refused here, before any process starts."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size == 1:
            return
        unsupported = {
            "enable_lora": self.enable_lora,
            "speculative_config": self.speculative_config,
        }
        for name, value in unsupported.items():
            if value:
                raise ValueError(f"{name}: not supported with tensor_parallel_size > 1 yet")

    def _check_lora(self) -> None:
        if self.lora_modules:
            self.enable_lora = True
        if self.enable_lora and not 1 <= self.max_loras <= 64:
            raise ValueError(f"max_loras: must be in [1, 64], got {self.max_loras}")
        if self.enable_lora and not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank: must be in [1, 512], got {self.max_lora_rank}")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(
                f"lora_modules: {len(self.lora_modules)} adapters but max_loras is {self.max_loras}"
            )

    @property
    def text_only_mode(self) -> bool:
        return all(v == 0 for v in self.limit_mm_per_prompt.values())

    def media_limits(self) -> MediaLimits:
        """The media caps the processor decodes a request's media under (``Gemma4Processor.process``)."""
        return MediaLimits(
            max_media_bytes=self.max_media_bytes,
            max_media_item_bytes=min(MediaLimits.max_media_item_bytes, self.max_media_bytes),
            max_media_pixels=self.max_media_pixels,
            max_request_pixels=self.max_request_pixels,
            max_video_frames=self.max_video_frames,
            # Decoding work follows the frame cap: max_video_frames frames of 1080p.
            video_max_decoded_pixels=self.max_video_frames * 1920 * 1080,
            max_audio_seconds=self.max_audio_seconds,
        )


def device_type(device: str | None) -> str:
    """The type of a device option: cuda, cpu, ... ("auto": cuda when torch sees a GPU); unknown names pass
    through (the engine refuses them when it opens the device)."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":", 1)[0]


def default_token_budget(kind: str) -> int:
    """``max_num_batched_tokens`` when none is given, by device type (``kind``). On CUDA 8,192, chosen by
    measurement on an H200 (the seed workloads of 30 prompts at once: e4b +19%, e2b +15%, 26b-a4b +11%
    total tokens/s against 2,048; 16,384 added nothing; served e4b at 64 QPS drained its queue sooner;
    docs/benchmarks.md). The price: a step that carries an 8k-token chunk is longer for the decodes beside
    it, and the sliding pool and activation reserve grow with the budget (31B on an H100: ~3.6 GB less KV
    room; its 32 x 8k-token fit in FP8 needs 2,048). On CPU 2,048: a step's activations stay small."""
    return 8192 if kind == "cuda" else 2048


__all__ = ["ATTENTION_BACKENDS", "MODALITIES", "EngineConfig", "default_token_budget", "device_type"]
