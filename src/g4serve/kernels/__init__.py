"""Triton kernels, one op per file, each beside its torch reference.

Every kernel runs compiled on CUDA tensors and in Triton's interpreter on CPU tensors (tests), so
importing this package needs neither a GPU nor the ``TRITON_INTERPRET`` variable.
"""
