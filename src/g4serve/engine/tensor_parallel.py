"""Tensor parallelism over processes: rank 0 is the engine; ranks 1..N-1 are workers started here.

Rank 0 owns everything that decides: the scheduler, the KV-cache manager (block tables, prefix cache), the
media encoders and the sampler. A worker holds its shard of the decoder and of the KV cache, nothing else.
Every step rank 0 broadcasts the step's inputs (``StepInputs``: token ids, block tables, soft tokens) over
the CPU group; every rank then runs the same forward, eager or the same captured CUDA graph, whose
all-reduces meet in the device group (NCCL on GPUs, gloo on CPUs). Only rank 0 samples, and broadcasts the
sampled tokens on the device group: with async scheduling the next step is launched before they reach the
host, and every rank reads them into its input ids on its device.

Start-up: rank 0 opens a TCP store, spawns the workers and waits until each has joined (a worker that dies
first is reported with its error); all load their shards at once; rank 0 plans the KV cache and sends the
plan (``WorkerPlan``), and each worker builds the same cache and graphs. A worker that fails later takes the
engine down with it: the next collective on rank 0 raises.

Shut-down: with NCCL, destroying the communicators is itself collective (``ncclCommDestroy`` waits for every
rank) and waits until every CUDA graph that captured one of its all-reduces is freed. So rank 0 frees its
step graphs first (``Engine.shutdown``), then tells the workers to stop; each frees its own step graphs the
same way (``ModelRunner.release_graphs``) and leaves the group while rank 0 leaves it too, each side bounded
by a timeout (a rank that does not come is given up on, with a warning, rather than hanging the process);
only then are the worker processes joined.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from g4serve import envs
from g4serve.distributed import TensorParallel
from g4serve.engine.config import EngineConfig
from g4serve.engine.inputs import PendingTokens
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.engine.model_runner import ModelRunner, StepInputs
from g4serve.layers.attention import BACKENDS
from g4serve.models.gemma4.kv_scales import fp8_kv_scales
from g4serve.models.gemma4.loader import checkpoint_dir, load_model

log = logging.getLogger("g4serve.engine")

# How long collectives may wait for a peer (a worker loading a large checkpoint, a long prefill on another
# rank); a dead peer is noticed sooner: gloo raises when its connection closes.
COLLECTIVE_TIMEOUT_S = envs.get_float("G4SERVE_TP_TIMEOUT_S")


# Every rank on rank 0's GPU, over gloo: how the tensor-parallel path (sharded shapes in the CUDA kernels,
# vocab-parallel embeddings, the step channel) is tested on a machine with one GPU. Not for serving: the ranks
# share one GPU and gloo's collectives cannot be captured in CUDA graphs (run it with enforce_eager).
def _one_device() -> bool:
    return envs.get("G4SERVE_TP_ONE_DEVICE") == "1"


_POLL_S = 0.2


@dataclass
class WorkerPlan:
    """What a worker needs from rank 0 to build the same KV cache and step runner."""

    num_blocks: dict[str, int]
    kv_dtype: torch.dtype
    pools: list[str]
    max_model_len: int
    decodable_vocab_size: int
    backend_name: str
    cuda_graphs: bool
    special_ids: dict[str, int]  # the model config's placeholder ids (a preset adopts the tokenizer's)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the GPU ``rank`` places after rank 0's, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + (0 if _one_device() else rank))


def _init_group(
    store: dist.Store, rank: int, size: int, device: torch.device, expert_parallel: bool
) -> TensorParallel:
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    backend = "nccl" if device.type == "cuda" and not _one_device() else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    if backend == "nccl":
        # NCCL sets up its communicator at the first collective: here, not inside a CUDA-graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return TensorParallel(rank, size, dist.group.WORLD, cpu_group, expert_parallel)


class StepChannel:
    """Rank 0 publishes each step's inputs, then the tokens it sampled; the workers receive both (a step of
    None: stop). With async scheduling a step's input token may be the previous step's sample, still on the
    device (``PendingTokens``): its rows travel with the step, its values are the previous broadcast."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self._samples: torch.Tensor | None = None  # a worker's copy of rank 0's last samples

    def publish(self, step: StepInputs | None) -> None:
        if step is not None:
            assert not step.has_drafts, "tensor parallel runs without speculative decoding"
            pending = step.pending
            # The workers need the counts and rows, not the requests; soft tokens travel on the host.
            step = replace(
                step,
                sampled=[None] * len(step.sampled),
                mm_rows=[r.cpu() for r in step.mm_rows],
                pending=None if pending is None else PendingTokens(pending.rows, pending.src, None),
            )
        self.tp.broadcast_object(step)

    def publish_samples(self, token_ids: torch.Tensor) -> None:
        # a copy: the samples may live in a CUDA graph's output, which the next replay rewrites, while NCCL
        # sends from its own stream
        self.tp.broadcast(token_ids.to(torch.int64, copy=True))

    def receive(self, device: torch.device) -> StepInputs | None:
        step = self.tp.broadcast_object(None)
        if step is not None and step.mm_rows:
            step.mm_rows = [r.to(device) for r in step.mm_rows]
        if step is not None and step.pending is not None:
            step.pending.tokens = self._samples
        return step

    def receive_samples(self, count: int, device: torch.device) -> None:
        """The tokens rank 0 sampled for the step just run (``count`` rows), kept for the next step."""
        self._samples = self.tp.broadcast(torch.empty(count, dtype=torch.int64, device=device))


class TensorParallelWorkers:
    """Rank 0's side: the worker processes, the group, and the step channel."""

    def __init__(self, config: EngineConfig, device: torch.device, model: str):
        size = config.tensor_parallel_size
        self.size = size
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            wait_for_workers=False,
        )
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(config, model, rank, size, self.store.port, rank_device(device, rank), os.getpid()),
                name=f"g4serve-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self.tp: TensorParallel | None = None
        try:
            self._wait_for("joined")
            self.tp = _init_group(self.store, 0, size, rank_device(device, 0), config.enable_expert_parallel)
        except BaseException:
            self.shutdown()
            raise
        self.channel = StepChannel(self.tp)
        log.info("tensor parallel: %d ranks (%s)", size, dist.get_backend())

    def _wait_for(self, stage: str) -> None:
        """Until every worker has set ``stage/<rank>``; a RuntimeError with its error if one exits first."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.size)]
        while not self.store.check(keys):
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    error = self._error(rank) or f"exit code {process.exitcode}"
                    raise RuntimeError(f"tensor parallel: rank {rank} failed before {stage}: {error}")
            time.sleep(_POLL_S)

    def _error(self, rank: int) -> str | None:
        key = f"error/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def start(self, plan: WorkerPlan) -> None:
        """Hand the workers the KV plan once they have loaded their shards; they build their caches and
        step graphs next (rank 0's ``ModelRunner`` captures its graphs at the same time)."""
        try:
            self._wait_for("loaded")
            self.tp.broadcast_object(plan)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (after the step in progress), leave the group with them, join them. Idempotent.
        Rank 0's CUDA graphs must be freed before (see the module's doc)."""
        healthy = self.tp is not None and all(p.is_alive() for p in self.processes)
        if healthy:
            try:
                self.channel.publish(None)
            except RuntimeError as exc:  # a worker is gone already
                log.warning("tensor parallel: stopping the workers: %s", exc)
                healthy = False
        if self.tp is not None:
            leave_group(healthy, timeout_s)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(1.0)
        self.tp = None


def leave_group(together: bool, timeout_s: float) -> bool:
    """Destroy this process's groups: with ``together`` (every rank does the same now) gracefully, else by
    aborting the communicators (a peer is gone: NCCL's graceful destroy would wait for it forever). Runs in
    a thread bounded by ``timeout_s``; False (and a warning) where it did not finish, the process going on
    without it. A no-op where no group is up."""
    if not dist.is_initialized():
        return True
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    leave = dist.destroy_process_group if together or abort is None else abort
    thread = threading.Thread(target=leave, name="g4serve-tp-leave", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("tensor parallel: the group was not destroyed within %.0f s; left as it is", timeout_s)
        return False
    return True


def _watch_parent(parent_pid: int) -> None:
    """A worker outlives no engine: it exits when rank 0's process is gone (even if killed)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(
    config: EngineConfig, model: str, rank: int, size: int, port: int, device: torch.device, parent_pid: int
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    log_format = f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        store.set(f"joined/{rank}", "1")
        tp = _init_group(store, rank, size, device, config.enable_expert_parallel)
        _serve_steps(config, model, tp, device, store)
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc(limit=8))
        leave_group(together=False, timeout_s=10.0)
        raise
    leave_group(together=True, timeout_s=30.0)


@torch.inference_mode()
def _serve_steps(
    config: EngineConfig, model_source: str, tp: TensorParallel, device: torch.device, store: dist.Store
) -> None:
    model = load_model(
        model_source,
        dtype=config.dtype,
        device=device,
        with_vision=False,  # the encoders run on rank 0
        with_audio=False,
        strict_config=config.strict_config,
        seed=config.seed,
        quantization=config.quantization,
        tp=tp,
    )
    if device.type == "cuda":
        model.prepare_fast_path()
    store.set(f"loaded/{tp.rank}", "1")
    plan: WorkerPlan = tp.broadcast_object(None)
    for name, value in plan.special_ids.items():
        setattr(model.cfg, name, value)
    model.init_nonpersistent_buffers()
    text = model.cfg.text
    scales = None
    if plan.kv_dtype != model.language_model.embed_tokens.weight.dtype:  # FP8: this rank's heads' scales
        scales = fp8_kv_scales(model, checkpoint_dir(model_source))
    cache = PagedKVCache(text, plan.num_blocks, config.block_size, plan.kv_dtype, device, scales)
    runner = ModelRunner(
        model,
        BACKENDS[plan.backend_name](text, cache),
        config,
        plan.pools,
        plan.max_model_len,
        decodable_vocab_size=plan.decodable_vocab_size,
        cuda_graphs=plan.cuda_graphs,
    )
    channel = StepChannel(tp)
    while (step := channel.receive(device)) is not None:
        runner.forward(step)
        if step.sampled:  # rank 0 sampled these rows and broadcasts the tokens
            channel.receive_samples(len(step.sampled), device)
    runner.release_graphs()  # rank 0 said stop: its graphs captured the all-reduces, freed before leaving
