"""Tensor parallelism's building blocks below the model: a rank's view of its group (``TensorParallel``) and
how a checkpoint's tensors split over the ranks (``sharding``). The processes themselves are started and fed
by ``g4serve.engine.tensor_parallel``."""

from g4serve.distributed.parallel import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
