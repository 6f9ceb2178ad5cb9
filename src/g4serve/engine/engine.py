"""The engine step loop: schedule -> encode media -> run the model -> sample -> update requests.

``LLMEngine`` owns the model, the paged KV cache (sized from a memory budget), the scheduler,
the encoder runner and cache, and the model runner. It is single-threaded; ``AsyncLLMEngine``
drives it from a background thread for the server. With ``async_scheduling`` a step is launched
before the previous step's samples are read back, so the host's bookkeeping overlaps the device.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from g4serve import envs
from g4serve.config import TextConfig
from g4serve.distributed import SINGLE
from g4serve.distributed.sharding import check_tensor_parallel
from g4serve.engine.config import PREPROCESS_WORKERS, EngineConfig, device_type
from g4serve.engine.encoder_runner import EncoderCache, EncoderRunner
from g4serve.engine.inputs import DeviceDrafts
from g4serve.engine.kv_cache import KVCacheManager, PagedKVCache, kv_cache_dtype
from g4serve.engine.kv_cache.planning import (
    activation_reserve,
    kv_budget,
    max_sequence_tokens,
    plan_kv_blocks,
)
from g4serve.engine.model_runner import ModelRunner, StepResult
from g4serve.engine.request import Request, RequestStatus, check_cache_salt, check_unicode, salt_digest
from g4serve.engine.scheduler import ScheduledBatch, Scheduler
from g4serve.engine.speculative import (
    MTPProposer,
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
    can_speculate,
    forced_verify,
    grammar_prefix,
    verify,
)
from g4serve.engine.step_profile import StepIntervals, StepProfile
from g4serve.engine.tensor_parallel import TensorParallelWorkers, WorkerPlan
from g4serve.layers.attention import BACKENDS, resolve_backend_name
from g4serve.layers.lora import LoRAWeights, projection_shapes
from g4serve.lora import LoRAAdapter, LoRARegistry, load_peft_adapter
from g4serve.models.gemma4.kv_scales import fp8_kv_scales
from g4serve.models.gemma4.loader import (
    SPECIAL_TOKENS,
    adopt_tokenizer_special_ids,
    checkpoint_dir,
    load_model,
    model_config,
)
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.outputs import RequestOutput
from g4serve.processing.device_media import device_memory_bound
from g4serve.processing.nvdec import NvdecVideos
from g4serve.processing.nvdec import memory_bound as nvdec_memory_bound
from g4serve.processing.processor import (
    Gemma4Processor,
    ProcessedPrompt,
    ProcessorSettings,
    bidirectional_spans,
)
from g4serve.processing.tokenizer import Tokenizer
from g4serve.sampling_params import SamplingParams
from g4serve.structured import (
    StructuredMatcher,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredSpec,
)
from g4serve.structured.reasoning import THOUGHT_CLOSE_TOKEN, THOUGHT_OPEN_TOKEN, ThoughtGate, thought_markers
from g4serve.tiny import default_model_dir
from g4serve.transfer import to_device

log = logging.getLogger("g4serve.engine")

# The steps' CUDA stream priority beside side-stream encodes: the highest there is (torch maps a number past
# the device's range to its end; lower is higher, the default stream's 0 is the lowest).
STEP_STREAM_PRIORITY = -100
# A request's priority value (scheduling_policy="priority"), either sign.
MAX_PRIORITY = 2**31 - 1


class AdapterNotLoadedError(ValueError):
    """A request names a LoRA adapter this engine does not hold (never loaded, or unloaded since)."""

    def __init__(self, name: str):
        super().__init__(f"model: no LoRA adapter named '{name}' is loaded")


class InflightStep:
    """A launched step: its batch, its result on the device, each request's computed tokens once it has
    run, and the copy of its samples to the host (started at launch, waited for in ``read``)."""

    def __init__(self, batch: ScheduledBatch, result: StepResult, computed: list[int]):
        self.batch = batch
        self.result = result
        self.computed = computed
        self._ready: torch.cuda.Event | None = None
        out = result.output
        tensors = () if out is None else (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)
        if out is not None and out.token_ids.is_cuda:
            # Into pinned host memory behind the step's kernels: the host waits for this step only, not
            # for a step launched after it.
            tensors = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in tensors)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._host = tensors

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a request sampled here needs its token on the host before its next step can launch: a
        grammar builds the next mask from it, penalties count it."""
        return any(
            not r.finished and (r.grammar is not None or r.sampling_params.has_penalties)
            for r in self.result.requests
        )

    def read(self) -> tuple[list, list | None, list | None, list | None]:
        """(token ids, logprobs, top ids, top logprobs) as lists, row per sampled request."""
        if not self._host:
            return [], None, None, None
        if self._ready is not None:
            self._ready.synchronize()
        token_ids, logprobs, top_ids, top_lps = (None if t is None else t.tolist() for t in self._host)
        return token_ids, logprobs, top_ids, top_lps


def _resolve_device(device: str) -> torch.device:
    return torch.device(device_type(device) if device in (None, "auto") else device)


def kv_reserve(config: EngineConfig, text: TextConfig, dtype: torch.dtype) -> int:
    """Bytes of the engine's GPU share the KV cache leaves free: a step's activations, and with media prepared
    on the GPU what ``DeviceMedia`` may hold (its bound at ``PREPROCESS_WORKERS`` threads, ~800 MB)."""
    reserve = activation_reserve(text, config.max_num_batched_tokens, dtype)
    if config.media_on_gpu:
        reserve += device_memory_bound(PREPROCESS_WORKERS)
    if config.video_decoder == "nvdec":
        reserve += nvdec_memory_bound(PREPROCESS_WORKERS)
    return reserve


class LLMEngine:
    """Wires the parts together: model and tokenizer, KV cache, encoder, scheduler, model runner."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tp_workers: TensorParallelWorkers | None = None  # the other ranks (tensor_parallel_size > 1)
        self.copy_outputs = True  # each step's RequestOutput owns its token list (see output_of)
        try:
            self._build(config)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:  # noqa: C901 - the parts, wired in order
        self.device = _resolve_device(config.device)
        backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.device, backend_name)  # None: the model's
        model_dir = checkpoint_dir(config.model) if config.model else default_model_dir()
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir or default_model_dir())
        limits = config.limit_mm_per_prompt
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            # checked before any process starts; the workers load their shards while rank 0 loads its own
            check_tensor_parallel(
                model_config(model_dir or config.model).text,
                config.tensor_parallel_size,
                config.enable_expert_parallel,
            )
            self.tp_workers = TensorParallelWorkers(config, self.device, str(model_dir or config.model))
            tp = self.tp_workers.tp
        self.model: Gemma4Model = load_model(
            model_dir or config.model,
            dtype=config.dtype,
            device=self.device,
            with_vision=limits.get("image", 0) > 0 or limits.get("video", 0) > 0,
            with_audio=limits.get("audio", 0) > 0,
            strict_config=config.strict_config,
            seed=config.seed,
            quantization=config.quantization,
            tp=tp,
        )
        self.model_config = self.model.cfg  # under tensor parallel: rank 0's shard of the decoder
        text = self.model_config.text
        if self.device.type == "cuda":
            self.model.prepare_fast_path()
        if model_dir is None:  # a preset
            adopt_tokenizer_special_ids(self.model_config, self.tokenizer)
            self.model.init_nonpersistent_buffers()
        self.processor = Gemma4Processor(
            self.tokenizer,
            self.model_config,
            ProcessorSettings.from_dir(model_dir),
            media_device=self.device if config.media_on_gpu else None,
            cache_bytes=int(config.mm_processor_cache_gb * (1 << 30)),
            nvdec=NvdecVideos(self.device) if config.video_decoder == "nvdec" else None,
        )
        self.media_limits = config.media_limits()  # what one request's media may cost to decode
        self.dtype = self.model.language_model.embed_tokens.weight.dtype
        self.lora: LoRARegistry | None = None  # the loaded adapters (EngineConfig.enable_lora)
        if config.enable_lora:
            fused = self.model.language_model.layers[0].mlp.gate_up_proj is not None  # the fast-path layout
            slots = LoRAWeights(
                projection_shapes(text),
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
                fused=fused,
            )
            self.lora = LoRARegistry(slots)
            log.info(
                "LoRA: %d adapter slots of rank %d (%.1f MiB)",
                config.max_loras,
                config.max_lora_rank,
                slots.num_bytes / 2**20,
            )
            for name, path in config.lora_modules.items():
                self.load_lora(name, path)

        budget = config.kv_cache_bytes
        if budget is None:
            budget = kv_budget(
                self.device, config.gpu_memory_utilization, kv_reserve(config, text, self.dtype)
            )
        kv_dtype = kv_dtype or self.dtype
        num_blocks = plan_kv_blocks(
            text,
            config.block_size,
            kv_dtype,
            budget,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            prefix_caching=config.enable_prefix_caching,
        )
        scales = fp8_kv_scales(self.model, model_dir) if kv_dtype != self.dtype else None
        self.kv_cache = PagedKVCache(text, num_blocks, config.block_size, kv_dtype, self.device, scales)
        self.kv = KVCacheManager(text, num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(self.kv.capacity_tokens())
        # No token spells more characters than the vocabulary's longest piece, so a longer text than this
        # cannot fit in max_model_len tokens: refused before the tokenizer spends seconds on it.
        longest_piece = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest_piece, 1)

        self.encoder_cache = EncoderCache(config.encoder_cache_tokens)
        graphs = self.device.type == "cuda" and not config.enforce_eager
        encoder_graphs = graphs and envs.get("G4SERVE_ENCODER_GRAPHS") == "1"  # read when an engine is built
        self.encoder = EncoderRunner(
            self.model, self.encoder_cache, overlap=config.overlap_encoder, cuda_graphs=encoder_graphs
        )
        # Decodes first: with encodes on the side stream (the lowest priority, the default stream's), the
        # steps run on a stream of the highest priority, so where both have work queued the GPU starts the
        # steps' blocks first and an encode fills what they leave.
        self.stream: torch.cuda.Stream | None = None
        if self.encoder.stream is not None:
            self.stream = torch.cuda.Stream(self.device, priority=STEP_STREAM_PRIORITY)
        self.scheduler = Scheduler(
            config,
            self.kv,
            encoder_cached=lambda digest: digest in self.encoder_cache,
            encoder_in_flight=self.encoder.in_flight,
            bidirectional_spans=text.use_bidirectional_attention == "vision",
            encoder_frames_done=self.encoder_cache.frames_done,
        )
        self.attention_backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        self.speculative = (
            SpeculativeConfig.parse(config.speculative_config) if config.speculative_config else None
        )
        step_graphs = graphs and self.attention_backend_name == "triton"
        if self.tp_workers is not None:
            self.tp_workers.start(
                WorkerPlan(
                    num_blocks,
                    kv_dtype,
                    self.kv.pool_types,
                    self.max_model_len,
                    self.tokenizer.vocab_size,
                    self.attention_backend_name,
                    step_graphs,
                    {f"{m}_token_id": getattr(self.model_config, f"{m}_token_id") for m in SPECIAL_TOKENS},
                )
            )
        self.runner = ModelRunner(
            self.model,
            BACKENDS[self.attention_backend_name](text, self.kv_cache),
            config,
            self.kv.pool_types,
            self.max_model_len,
            decodable_vocab_size=self.tokenizer.vocab_size,
            cuda_graphs=step_graphs,
            lora_weights=self.lora.weights if self.lora is not None else None,
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else 0,
            publisher=self.tp_workers.channel if self.tp_workers is not None else None,
        )
        self.proposer = self._make_proposer(self.speculative) if self.speculative else None
        self.spec_stats = SpecStats()
        self._forced_rng = np.random.default_rng(config.seed or 0)  # forced_acceptance draws (benchmarks)
        self.requests: dict[str, Request] = {}
        # Constrained decoding loads xgrammar with the first request that needs it.
        self._structured: StructuredOutputBackend | None = None
        self._structured_lock = threading.Lock()
        self.thought_markers = thought_markers(self.tokenizer)
        self._inflight: InflightStep | None = None  # async scheduling: launched, not yet read back
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps launched while the previous one was still in flight
        self.profile = StepProfile()  # the engine thread's time by phase (step_profile.py)
        self.step_intervals = StepIntervals()  # the engine-side inter-token latency by step kind
        self.num_generated_tokens = 0  # output tokens, forced ones included
        self.num_forced_tokens = 0  # of those, the ones jump-forward appended
        self.num_prompt_tokens = 0
        if self.device.type == "cuda":
            self.warmup()
        self.started = time.monotonic()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing else holds processes or devices). Idempotent; the engine
        cannot step afterwards."""
        if self.tp_workers is not None:
            if (runner := getattr(self, "runner", None)) is not None:  # None: the start failed before it
                runner.release_graphs()  # they captured NCCL all-reduces: freed before the group goes
            self.tp_workers.shutdown()

    def _make_proposer(self, spec: SpeculativeConfig) -> NgramProposer | MTPProposer:
        if spec.method == "ngram":
            return NgramProposer(spec)
        from g4serve.models.gemma4.assistant import load_assistant

        text, seed = self.model_config.text, self.config.seed or 0
        drafter = load_assistant(spec.model, text, self.dtype, self.device, seed)
        self.runner.keep_hidden = True  # the drafter starts from the target's final hidden states
        draft_graphs = None
        if self.runner.decode_graphs is not None:  # a round per batch size the decode graphs hold
            draft_graphs = self.runner.draft_graphs(drafter, spec.num_speculative_tokens, capture=True)
        return MTPProposer(spec, drafter, self.model, draft_graphs, self.runner.decodable_vocab_size)

    def _max_model_len(self, capacity: dict[str, int]) -> int:
        """The config's (or the model's) context length, capped where one sequence would not fit the KV
        pools alone (then preemption could never make room for it)."""
        log.info("KV cache: %s", ", ".join(f"{pool} pool {n} tokens" for pool, n in capacity.items()))
        text, cfg = self.model_config.text, self.config
        length = min(cfg.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        limit = max_sequence_tokens(capacity, text, cfg.block_size, cfg.max_num_batched_tokens)
        if limit is not None and limit < length:
            log.warning(
                "KV cache holds %d tokens per sequence at most: max_model_len lowered from %d", limit, length
            )
            length = max(limit, 1)
        return length

    def warmup(self) -> None:
        """Compile the kernels (Triton JIT, cuBLAS heuristics) on throwaway prefills and decodes, so the first
        client requests do not pay seconds of compilation: greedy rows, and sampled ones (the noise and the
        sort-free top-p kernels, the top-k path, logprobs); leaves no trace in the cache or the counters."""
        t0 = time.monotonic()
        vocab = min(self.tokenizer.vocab_size, self.model_config.text.vocab_size)
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        runs = [
            (16, greedy),
            (min(512, self.max_model_len - 8), greedy),
            (16, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True, seed=0)),
            (
                16,
                SamplingParams(
                    temperature=1.0, top_k=64, top_p=0.95, max_tokens=3, ignore_eos=True, logprobs=2
                ),
            ),
        ]
        placeholders = set(self.processor.placeholder_ids.values())
        usable = [t for t in range(min(vocab, 4096)) if t not in placeholders and t > 16]
        for i, (length, params) in enumerate(runs):
            ids = [usable[(7 * j + i) % len(usable)] for j in range(length)]
            request = self.make_request(f"warmup-{i}", self.process_prompt({"prompt_token_ids": ids}), params)
            self.add_request(request)
        self.run_until_finished()
        self._capture_vision_buckets()
        self._capture_audio_buckets()
        self.kv.reset_prefix_cache()
        self.num_steps = self.num_overlapped_steps = self.num_generated_tokens = self.num_prompt_tokens = 0
        self.num_forced_tokens = 0
        self.scheduler.num_preemptions = 0
        self.spec_stats = SpecStats()
        self.profile.reset()
        self.step_intervals = StepIntervals()
        self.kv.prefix_queries = self.kv.prefix_hit_tokens = self.kv.prefix_query_tokens = 0
        log.info("warm-up done in %.1fs", time.monotonic() - t0)

    def _capture_vision_buckets(self) -> None:
        """Capture the vision encoder's graphs for every frame bucket of the default shapes (a 640x480 image,
        a 16:9 video frame at the processor's defaults), so a burst of media requests replays graphs from
        its first step instead of capturing new shapes under load. Nothing without vision graphs."""
        if self.encoder.vision_graphs is None:
            return
        t0 = time.monotonic()
        limits = self.config.limit_mm_per_prompt
        samples = [
            ("image", np.zeros((480, 640, 3), np.uint8)),
            ("video", [[np.zeros((480, 854, 3), np.uint8)]]),  # one video of one frame
        ]
        items = []
        for modality, media in samples:
            if limits.get(modality, 0) <= 0:
                continue
            try:
                processed = self.process_prompt(
                    {"prompt": f"<|{modality}|>", "multi_modal_data": {modality: media}}
                )
            except ValueError as exc:  # limits that refuse the sample: its shapes are captured when seen
                log.warning("vision warm-up skipped the %s shape: %s", modality, exc)
                continue
            items.append(processed.mm_items[0])
        new = self.encoder.capture_vision_buckets(items)
        log.info("vision-encoder graphs: %d frame buckets captured in %.1fs", new, time.monotonic() - t0)

    def _capture_audio_buckets(self) -> None:
        """Capture the audio encoder's graphs of one clip at every frame bucket up to the longest clip the
        processor makes (``max_audio_seconds``), so a first audio request replays a graph. Nothing without
        audio graphs."""
        if self.encoder.audio_graphs is None or self.config.limit_mm_per_prompt.get("audio", 0) <= 0:
            return
        t0 = time.monotonic()
        seconds = self.config.max_audio_seconds
        try:
            processed = self.process_prompt(
                {
                    "prompt": "<|audio|>",
                    "multi_modal_data": {"audio": [np.zeros(int(16000 * seconds), np.float32)]},
                }
            )
        except ValueError as exc:
            log.warning("audio warm-up skipped: %s", exc)
            return
        new = self.encoder.capture_audio_buckets(processed.mm_items[0])
        log.info("audio-encoder graphs: %d frame buckets captured in %.1fs", new, time.monotonic() - t0)

    # ---- LoRA adapters ------------------------------------------------------------------------------
    def lora_registry(self) -> LoRARegistry:
        """The loaded adapters; ``ValueError`` when this engine serves none."""
        if self.lora is None:
            raise ValueError("lora_name: this engine serves no LoRA adapters (start it with --enable-lora)")
        return self.lora

    def load_lora(self, name: str, path: str, confine_to: str | None = None) -> None:
        """Read, check and load the PEFT adapter at ``path`` under ``name``. Raises ``ValueError`` naming
        what is wrong. ``confine_to``: a directory its files must lie under, links resolved."""
        self.lora_registry().check_name(name)
        self.add_lora(name, self.read_lora(path, confine_to))

    def read_lora(self, path: str, confine_to: str | None = None) -> LoRAAdapter:
        """Read and check an adapter for this model (file reads only: any thread)."""
        cfg, rank = self.model_config.text, self.config.max_lora_rank
        return load_peft_adapter(path, cfg, rank, self.dtype, confine_to=confine_to)

    def add_lora(self, name: str, adapter: LoRAAdapter) -> None:
        """Load a read adapter into a free slot (engine thread, between steps)."""
        self.lora_registry().add(name, adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d)", name, adapter.path, adapter.rank)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests cannot name it; running ones finish with it."""
        if self.lora is None or name not in self.lora:
            raise KeyError(name)
        self.lora.remove(name)
        log.info("LoRA adapter %r unloaded", name)

    # ---- requests ----------------------------------------------------------------------------------
    def process_prompt(self, prompt: str | dict, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Tokenize and preprocess media (CPU work; the async engine runs it off the step loop). A prompt
        too long to fit ``max_model_len`` whatever its tokens is refused before any of that work. A dict's
        ``cache_salt`` is kept on the result: its KV blocks are then shared only under the same salt."""
        salt = None  # a dict's cache_salt (None: none), checked before any tokenizing or media work
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = check_cache_salt(prompt["cache_salt"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            if len(text) > self.max_prompt_chars:
                raise ValueError(
                    f"prompt: {len(text)} characters cannot fit in max_model_len={self.max_model_len} "
                    f"tokens (at most {self.max_prompt_chars} characters)"
                )
            check_unicode(text, "prompt")
        processed = self.processor.process(
            prompt, self.config.limit_mm_per_prompt, add_special_tokens, media_limits=self.media_limits
        )
        processed.cache_salt = salt
        return processed

    def make_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Check a request and build it (not yet queued). ``lora_name``: a loaded adapter to run it with."""
        if lora_name is not None and (self.lora is None or lora_name not in self.lora):
            raise AdapterNotLoadedError(lora_name)
        self._check_priority(priority)
        n_prompt = len(processed.token_ids)
        if n_prompt == 0:
            raise ValueError("prompt: is empty")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: {n_prompt} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        self._check_fits(processed, params)
        vocab = self.model_config.text.vocab_size
        placeholders = set(self.processor.placeholder_ids.values())
        bad = next((t for t in processed.token_ids if not 0 <= t < vocab and t not in placeholders), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary (size {vocab})")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary (size {vocab})")
        kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
        return Request(
            request_id=request_id,
            prompt=processed.prompt,
            prompt_token_ids=processed.token_ids,
            sampling_params=params,
            eos_token_ids=self.model_config.text.eos_token_ids,
            tokenizer=self.tokenizer,
            mm_items=processed.mm_items,
            max_total_tokens=self.max_model_len,
            priority=priority,
            grammar=self._new_grammar(params),
            jump_forward=self._jumps(params),
            lora_name=lora_name,
            cache_salt=salt_digest(processed.cache_salt),
            **kwargs,
        )

    def _check_priority(self, priority: int) -> None:
        """Under ``fcfs`` a priority is refused, not ignored: a client that asked to go first learns it
        does not. The bound keeps the sort key a machine integer (Python's are unbounded)."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority: {priority} is not honoured: this server schedules first come, first served "
                "(start it with --scheduling-policy priority to order requests by priority)"
            )
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority: must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}")

    def _check_fits(self, processed: ProcessedPrompt, params: SamplingParams) -> None:
        """Refuse what could never be scheduled, instead of letting it wait forever at the queue's head."""
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(processed.token_ids) > budget:
            raise ValueError(
                f"prompt: {len(processed.token_ids)} tokens must be prefilled in one step without chunked "
                f"prefill, but max_num_batched_tokens is {budget}"
            )
        if self.scheduler.bidirectional_spans:
            longest = max((e - s for s, e in bidirectional_spans(processed.mm_items)), default=0)
            if longest > self.config.max_num_batched_tokens:
                raise ValueError(
                    f"multi_modal_data: an image of {longest} soft tokens must be prefilled in one "
                    f"step, but max_num_batched_tokens is {self.config.max_num_batched_tokens}"
                )

    def _jumps(self, params: SamplingParams) -> bool:
        """Whether a request jumps over forced text: jump-forward is on, its output is constrained, and it
        asks for no logprobs (forced tokens are not sampled, so they would have none)."""
        return self.config.jump_forward and params.structured_output is not None and params.logprobs is None

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        if request.lora_name is not None and (self.lora is None or request.lora_name not in self.lora):
            # Unloaded since make_request checked it: the request fails alone.
            raise AdapterNotLoadedError(request.lora_name)
        if request.grammar is None:
            request.grammar = self._new_grammar(request.sampling_params)
            request.jump_forward = self._jumps(request.sampling_params)
        params = request.sampling_params
        if (
            request.jump_forward
            and request.grammar is not None
            and not request.output_token_ids
            and not (params.stop or params.stop_token_ids)
        ):
            # Text the grammar forces before any token ('{"intent": "') joins the prompt's prefill. The
            # request must not end before its first step: one token is left for the model, and a request with
            # stop strings or stop ids of its own (which forced text could hit) first jumps after a sample.
            forced = request.grammar.jump_forward(None, request.max_output_tokens - 1)
            request.append_forced(forced)
            self.num_generated_tokens += request.num_forced_tokens
            self.num_forced_tokens += request.num_forced_tokens
        if request.lora_name is not None and request.lora_slot < 0:
            # From here the request is registered: _finish gives the slot back, whatever happens to it.
            request.lora_slot, uid = self.lora.acquire(request.lora_name)
            request.cache_salt += b"lora:%d" % uid  # K/V depend on the adapter's k/v deltas
        self.requests[request.request_id] = request
        self._extend_block_hashes(request)
        self._pin_media(request)
        self.num_prompt_tokens += len(request.prompt_token_ids)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.abort()
        self._finish(request)

    @property
    def built_structured_backend(self) -> StructuredOutputBackend | None:
        """The grammar backend if a grammar has built it, else None (building it reads the whole vocabulary:
        not on an event loop)."""
        return self._structured

    @property
    def structured_backend(self) -> StructuredOutputBackend:
        """Grammar compiler and cache for constrained decoding (any thread may compile)."""
        with self._structured_lock:
            if self._structured is None:
                text = self.model_config.text
                stop = [t for t in text.eos_token_ids or [self.tokenizer.eos_token_id] if t is not None]
                self._structured = StructuredOutputBackend(self.tokenizer, text.vocab_size, stop)
            return self._structured

    def _new_grammar(self, params: SamplingParams) -> StructuredMatcher | ThoughtGate | None:
        """The request's grammar state; compile errors raise StructuredOutputError here, before it is
        queued. With thinking on, or a reasoning budget, the grammar waits behind the thought channel."""
        spec = params.structured_output
        inner = None
        if spec is not None:
            if not isinstance(spec, StructuredSpec):
                raise StructuredOutputError(
                    "structured_output: expected a StructuredSpec "
                    "(e.g. StructuredSpec.from_response_format(...)), "
                    f"got {type(spec).__name__}"
                )
            inner = self.structured_backend.new_matcher(spec)
        budget = params.max_reasoning_tokens is not None
        if not (budget or (params.thinking and inner is not None)):
            return inner
        if self.thought_markers is None:
            if not budget:  # no thought channel in this vocabulary: nothing to wait for
                return inner
            raise ValueError(
                f"max_reasoning_tokens: this model's tokenizer has no {THOUGHT_OPEN_TOKEN} / "
                f"{THOUGHT_CLOSE_TOKEN} thought channel"
            )
        return ThoughtGate(self.thought_markers, inner, params.max_reasoning_tokens)

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, a launched step still to read back for one of them, or encodes in flight.
        (A launched step whose requests were all aborted is not waited for: the next step drops it.)"""
        inflight = self._inflight is not None and any(
            r.status is not RequestStatus.FINISHED for r in self._inflight.batch.requests
        )
        return self.scheduler.has_unfinished() or inflight or self.encoder.num_in_flight > 0

    def run_until_finished(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each, by request id."""
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return finished

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = time.monotonic()
        self.scheduler.remove(request)
        if request.lora_slot >= 0:
            self.lora.release(request.lora_slot)
            request.lora_slot = -1
        self.runner.token_counts.release(request.request_id)
        for digest in request.pinned_media:
            self.encoder_cache.release(digest)
        request.pinned_media.clear()
        self.requests.pop(request.request_id, None)

    def _pin_media(self, request: Request) -> None:
        """Keep the request's encoder outputs cached until its prefill has consumed them."""
        for item in request.mm_items:
            if (
                item.content_hash not in request.pinned_media
                and item.spans[-1][1] > request.num_computed_tokens
            ):
                request.pinned_media.add(item.content_hash)
                self.encoder_cache.acquire(item.content_hash)

    def _unpin_consumed(self, request: Request) -> None:
        for item in request.mm_items:
            if item.content_hash in request.pinned_media and item.spans[-1][1] <= request.num_computed_tokens:
                request.pinned_media.discard(item.content_hash)
                self.encoder_cache.release(item.content_hash)

    def _extend_block_hashes(self, request: Request) -> None:
        """Digests of the request's newly filled blocks, chained onto the ones it has (O(new tokens))."""
        bs = self.config.block_size
        have = len(request.block_hashes)
        full = request.num_known_tokens // bs
        if full <= have:
            return
        extra = []
        for i in range(have, full):
            lo, hi = i * bs, (i + 1) * bs
            extra.append(
                [it.content_hash for it in request.mm_items if it.offset < hi and it.spans[-1][1] > lo]
            )
        request.block_hashes += KVCacheManager.hash_blocks(
            request.token_ids_between(have * bs, full * bs),
            bs,
            extra,
            previous=request.block_hashes[-1] if have else request.cache_salt,
        )

    # ---- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs of the requests that got a token. With async
        scheduling these come from the step launched by the previous call, read back after this call
        launched the next one.

        A fault while scheduling, encoding, preparing, running or sampling fails exactly the requests of
        the step (and of the launched step not yet read back, whose tokens it consumed): each ends with
        finish_reason "error" and an ``error`` message in its output, returns its KV blocks, and the engine
        serves on. A fault in one request's read-back (grammar, detokenizer) fails that request alone.

        With the step stream (``overlap_encoder`` on CUDA) the step runs on it, after whatever the caller's
        stream had queued (weights, adapters, captures) and before whatever it queues next."""
        if self.stream is None:
            return self._step()
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                return self._step()
        finally:
            caller.wait_stream(self.stream)

    def _step(self) -> list[RequestOutput]:
        previous, self._inflight = self._inflight, None
        batch: ScheduledBatch | None = None
        current: InflightStep | None = None
        outputs: list[RequestOutput] = []
        profile = self.profile
        try:
            if previous is not None and (previous.needs_host_tokens or self.proposer is not None):
                # A grammar mask or penalty of the next step depends on the tokens just sampled; so do the
                # drafts of speculative decoding (verified, then proposed from what was accepted).
                outputs += self._complete(previous)
                previous = None
            t = profile.now()
            self._collect_encodes()
            t = profile.add("encode", t)
            batch = self.scheduler.schedule()
            self._note_scheduled(batch)
            t = profile.add("schedule", t)
            if batch.encoder_items:
                self._encode(batch)
                t = profile.add("encode", t)
            current = self._launch(batch, previous) if batch.requests else None
            t = profile.add("launch", t)
            if current is None and previous is None and self.encoder.num_in_flight:
                self.encoder.wait()  # nothing runs but encodes: wait for one instead of spinning
                profile.add("wait", t)
            if previous is not None:
                outputs += self._complete(previous)
                self.num_overlapped_steps += current is not None
            if current is not None:
                if self.config.async_scheduling:
                    self._inflight = current
                else:
                    outputs += self._complete(current)
        except Exception as exc:
            outputs += self._fail_step(exc, previous, batch)
        except BaseException:  # KeyboardInterrupt, SystemExit: stop, leaving no request half-run
            self._fail_step(None, previous, batch)
            raise
        return outputs

    def _fail_step(
        self, exc: Exception | None, previous: InflightStep | None, batch: ScheduledBatch | None
    ) -> list[RequestOutput]:
        """Fail the unfinished requests of a step that raised: its batch, and the launched step it would have
        read back. When the fault came before the step had a batch (scheduler, encoder poll) and nothing was
        in flight, no request's state can be vouched for: all of them fail, rather than the same fault
        repeating every step while their clients wait."""
        self._inflight = None
        suspects = list(batch.requests if batch is not None else ())
        suspects += previous.batch.requests if previous is not None else ()
        if batch is None and previous is None:
            suspects = list(self.requests.values())
        failed = list({id(r): r for r in suspects if r.status is not RequestStatus.FINISHED}.values())
        reason = "interrupted" if exc is None else type(exc).__name__
        if exc is not None:
            log.error(
                "engine step failed (%s); failing its %d request(s): %s",
                reason,
                len(failed),
                ", ".join(r.request_id for r in failed),
                exc_info=exc,
            )
        outputs = []
        for request in failed:
            request.fail(f"internal error ({reason}) while running the step of request {request.request_id}")
            self._finish(request)
            outputs.append(self.output_of(request))
        return outputs

    def _note_scheduled(self, batch: ScheduledBatch) -> None:
        """Bookkeeping for a new schedule: preempted requests re-pin their media, first-time requests
        record when they were first scheduled."""
        for request in batch.preempted:
            self._pin_media(request)  # it will recompute from scratch
        now = time.monotonic()
        for request in batch.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now

    def _launch(self, batch: ScheduledBatch, previous: InflightStep | None) -> InflightStep:
        """Run the model and sample, without waiting for the device; the requests' computed tokens
        advance now, their samples become pending outputs."""
        result = self.runner.execute(
            batch, self.kv, self.encoder_cache, previous.result if previous else None
        )
        self.num_steps += 1
        computed = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            computed.append(request.num_computed_tokens)
            self._unpin_consumed(request)
            # Registered now, not at read-back: the next schedule may free sliding blocks that leave the
            # window, and a block freed unregistered is lost to the prefix cache. Steps run in stream order,
            # so whoever reuses a block launched here reads it after this step has written it.
            self.kv.register_computed_blocks(
                request.request_id, request.block_hashes, request.num_computed_tokens
            )
        for request in batch.requests:
            request.draft_token_ids = []  # verified by this step (the runner set ``verifying``), or stale
            if request.verifying_source is not None:  # to the host behind the step, read with its samples
                request.verifying_source[0].start_copy()
        for request in dict.fromkeys(result.requests):  # once per request, however many rows it sampled
            request.num_pending_outputs += 1
        return InflightStep(batch, result, computed)

    def _encode(self, batch: ScheduledBatch) -> None:
        """The batch's new media: encoded now (before its forward), or started on the encoder's stream."""
        if self.config.overlap_encoder:
            self.encoder.start(batch.encoder_items)
            return
        # CPU: charged now; CUDA: timed by events, charged by ``_collect_encodes`` once done
        self._charge_encodes(self.encoder.run(batch.encoder_items, batch.encoder_frames))

    def _collect_encodes(self) -> None:
        """Cache the encodes the side stream has finished, and charge their time (and that of the encodes
        finished in earlier steps, timed by events) to the requests."""
        self._charge_encodes(self.encoder.poll())

    def _charge_encodes(self, finished: list[tuple[frozenset[str], float]]) -> None:
        """Each finished encode's seconds, once, to every request with an item in it (a request with two
        images in one encode waited for it once; a video's frames may encode in steps its request sits out,
        with ``max_encoder_tokens_beside_decodes``)."""
        if not finished:
            return
        for request in self.requests.values():
            digests = {it.content_hash for it in request.mm_items}
            request.metrics.encoder_time_s += sum(seconds for done, seconds in finished if digests & done)

    def _complete(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for the step's samples, append them to their requests and register the new full blocks
        with the prefix cache; requests that finished meanwhile (aborted, or stopped by the previous
        step) drop theirs."""
        done_before = {id(r) for r in step.batch.requests if r.status is RequestStatus.FINISHED}
        t = self.profile.now()
        token_ids, logprobs, top_ids, top_lps = step.read()
        t = self.profile.add("wait", t)
        self.step_intervals.observe(_step_kind(step.batch), 1 in step.batch.num_new_tokens)
        try:
            return self._take_samples(step, done_before, token_ids, logprobs, top_ids, top_lps)
        finally:
            self.profile.add("outputs", t)

    def _take_samples(
        self, step: InflightStep, done_before: set[int], token_ids, logprobs, top_ids, top_lps
    ) -> list[RequestOutput]:
        """``_complete`` once the step's samples are on the host."""
        now = time.monotonic()
        last_rows: dict[int, int] = {}  # request -> the row that sampled its last token (for the drafter)
        for request, rows in _rows_by_request(step.result.requests).items():
            request.num_pending_outputs -= 1
            verifying = request.take_verifying()
            if request.finished:
                continue
            try:
                if verifying:
                    last_rows[id(request)] = self._accept_drafts(
                        request, verifying, rows, token_ids, logprobs, top_ids, top_lps, now
                    )
                else:
                    self._accept(request, rows[0], token_ids, logprobs, top_ids, top_lps, now)
                    last_rows[id(request)] = rows[0]
            except Exception as exc:  # one request's bad state (grammar, detokenizer) fails it alone
                log.exception("request %s: its sampled token could not be taken", request.request_id)
                reason = type(exc).__name__
                request.fail(f"internal error ({reason}) while reading back request {request.request_id}")
        if self.proposer is not None:
            self._propose(step, last_rows)
        sampled = set(map(id, step.result.requests))
        outputs = []
        for request, computed in zip(step.batch.requests, step.computed):
            if id(request) in done_before:
                continue
            # Blocks completed by the tokens just read back. A request preempted since the launch has fewer
            # computed tokens now.
            computed = min(computed, request.num_computed_tokens)
            self.kv.register_computed_blocks(request.request_id, request.block_hashes, computed)
            if id(request) in sampled:
                outputs.append(self.output_of(request))
                if request.finished:
                    self._finish(request)
        return outputs

    def _accept_drafts(
        self, request: Request, drafts: list[int], rows: list[int], token_ids, logprobs, top_ids, top_lps, now
    ) -> int:
        """Verify a request's drafts against its rows' samples, append what is accepted plus the target's
        own token, and roll its computed tokens back to the last accepted draft; returns the row that
        sampled the last appended token."""
        sampled = [token_ids[r] for r in rows]
        forced = self.speculative.forced_acceptance
        if forced is None:
            tokens = verify(drafts, sampled)
        else:
            tokens = forced_verify(len(drafts), sampled, forced, self._forced_rng)
        accepted = len(tokens) - 1
        self.spec_stats.record(len(drafts), accepted)
        # The K/V of the rejected drafts' rows is garbage: the next step overwrites it.
        request.num_computed_tokens -= len(drafts) - accepted
        before = len(request.output_token_ids)
        for i, token in enumerate(tokens):
            if request.finished:
                break
            if request.grammar is not None and not request.grammar.accept_token(token):
                # the row's mask held the grammar's state after the drafts before it: impossible
                self._grammar_rejected(request, token)
                break
            top = list(zip(top_ids[rows[i]], top_lps[rows[i]])) if top_ids is not None else None
            request.append_token(token, None if logprobs is None else logprobs[rows[i]], top, now)
        self.num_generated_tokens += len(request.output_token_ids) - before
        self._extend_block_hashes(request)
        return rows[len(request.output_token_ids) - before - 1]

    def _propose(self, step: InflightStep, last_rows: dict[int, int]) -> None:
        """Drafts for the next step of every request that sampled here and may speculate."""
        # Forced acceptance (benchmarks) takes rows' samples a grammar's draft chain did not mask for.
        forced = self.speculative.forced_acceptance is not None
        requests = [
            r
            for r in dict.fromkeys(step.result.requests)
            if id(r) in last_rows and can_speculate(r) and not (forced and r.grammar is not None)
        ]
        # Room for the drafts and the target's own token: max_tokens and max_model_len.
        budgets = [
            min(r.max_output_tokens - r.num_output_tokens, r.max_total_tokens - r.num_tokens) - 1
            for r in requests
        ]
        keep = [i for i, b in enumerate(budgets) if b > 0]
        requests, budgets = [requests[i] for i in keep], [budgets[i] for i in keep]
        if not requests:
            return
        extra = {}
        if self.proposer.needs_hidden:
            rows = to_device([last_rows[id(r)] for r in requests], torch.long, self.device)
            extra = dict(
                hidden=step.result.hidden[rows],
                tables=[self.kv.block_tables(r.request_id) for r in requests],
                backend=self.runner.backend,
                block_size=self.config.block_size,
            )
        # MTP drafts stay on the device unless a grammar must cut them now (see inputs.DeviceDrafts).
        on_device = self.proposer.needs_hidden and all(r.grammar is None for r in requests)
        drafts = self.proposer.propose(requests, budgets, on_device=on_device, **extra)
        if isinstance(drafts, DeviceDrafts):
            width = drafts.tokens.shape[1]
            for i, (request, budget) in enumerate(zip(requests, budgets)):
                request.set_device_drafts(drafts, i, min(width, budget))
            return
        for request, tokens in zip(requests, drafts):
            if request.grammar is not None:
                tokens = grammar_prefix(request.grammar, list(tokens))
            request.set_drafts(tokens)

    @staticmethod
    def _grammar_rejected(request: Request, token: int) -> None:
        """The grammar refused the token its own mask let through. Where the mask was empty (a grammar with
        no way on from here, which admission cannot always see: ``a`` then a character no token holds) the
        client's grammar is at fault: the request fails with a 400. Anything else is a broken state."""
        grammar = request.grammar
        if grammar.allows_nothing():
            request.fail(
                f"{grammar.spec.field}: no output satisfies it (after {grammar.num_accepted} output tokens "
                "the grammar allows no token, not even the end)",
                status=400,
            )
            return
        raise RuntimeError(f"token {token} violates the request's {grammar.spec.kind} grammar")

    def _accept(self, request: Request, row: int, token_ids, logprobs, top_ids, top_lps, now: float) -> None:
        """Append row ``row``'s sampled token (and its logprobs) to ``request``."""
        token = token_ids[row]
        if request.grammar is not None and not request.grammar.accept_token(token):
            self._grammar_rejected(request, token)
            return
        tokens = [token]
        if request.jump_forward:
            # The sampled token's K/V is not computed yet (a grammar request is read back before its next step
            # is scheduled), so the jump may re-spell it with the forced text that follows; the next step
            # computes them all as one chunk.
            budget = request.max_output_tokens - len(request.output_token_ids)
            tokens = request.grammar.jump_forward(token, budget)
        top = list(zip(top_ids[row], top_lps[row])) if top_ids is not None else None
        before = len(request.output_token_ids)
        forced_before = request.num_forced_tokens
        request.append_token(tokens[0], None if logprobs is None else logprobs[row], top, now)
        if len(tokens) > 1:
            request.append_forced(tokens[1:], now)
        self.num_generated_tokens += len(request.output_token_ids) - before
        self.num_forced_tokens += request.num_forced_tokens - forced_before
        self._extend_block_hashes(request)

    def output_of(self, request: Request) -> RequestOutput:
        """The request's output now. ``copy_outputs`` False (``AsyncLLMEngine``, which reads every output on
        this thread before the next step): its token list is the request's own, not a copy."""
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[request.completion(copy=self.copy_outputs)],
            finished=request.finished,
            metrics=request.metrics,
            # Prompt tokens served from the cache: with jump-forward a hit may reach into the text forced at
            # admission, which is output, not prompt (metrics.prefix_hit_tokens keeps the whole hit).
            num_cached_tokens=min(request.metrics.prefix_hit_tokens, len(request.prompt_token_ids)),
            error=request.error,
            error_status=request.error_status,
        )

    # ---- introspection ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_capacity_tokens": self.kv.capacity_tokens(),
            "kv_usage": self.kv.usage(),
            "kv_free_blocks": {name: pool.num_free for name, pool in self.kv.pools.items()},
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hit_tokens": self.kv.prefix_hit_tokens,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "encoder_cache_hits": self.encoder_cache.hits,
            "encoder_cache_misses": self.encoder_cache.misses,
            "encoder_calls": len(self.encoder.calls),
            "mm_processor_cache": self.processor.cache.stats() if self.processor.cache is not None else None,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            "engine_thread_seconds": dict(self.profile.seconds),
            "engine_thread_cpu_seconds": dict(self.profile.cpu_seconds),
            "step_intervals": self.step_intervals.snapshot(),
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generated_tokens,
            "forced_tokens_total": self.num_forced_tokens,
            "generation_tokens_per_s": self.num_generated_tokens / elapsed,
            # speculative decoding, per draft position (empty without it)
            "spec_drafted_tokens": list(self.spec_stats.drafted),
            "spec_accepted_tokens": list(self.spec_stats.accepted),
        }


def _step_kind(batch: ScheduledBatch) -> str:
    """What a step carried beside its decode rows (``step_profile.STEP_KINDS``): media encodes, prompt
    tokens, or nothing."""
    if batch.encoder_items:
        return "encode"
    return "prefill" if any(n > 1 for n in batch.num_new_tokens) else "decode"


def _rows_by_request(requests: list[Request]) -> dict[Request, list[int]]:
    """The rows each request sampled (several when it verified drafts), in row order."""
    rows: dict[Request, list[int]] = {}
    for row, request in enumerate(requests):
        rows.setdefault(request, []).append(row)
    return rows
