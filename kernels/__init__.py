"""Kernels of tpool: one module per operation, a Triton kernel and its numba twin.

Installed as ``tpool.kernels``. Every function here is a pure function over
state tensors (Triton) or state arrays (numba); the classes that own the
state live in ``tpool``. The state layout is in :mod:`tpool.kernels.layout`.
"""
