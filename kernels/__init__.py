"""Kernels: each Triton kernel sits beside its torch reference and one dispatcher picks between them.

The dispatcher uses Triton on CUDA (see `core.device`) and the reference elsewhere; tests run the
Triton kernels on the CPU with `TRITON_INTERPRET=1` on small shapes and compare.
"""
