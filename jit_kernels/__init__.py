"""CUDA sources for sglang_hisparse, compiled at run time (see sglang_hisparse/kernels/_jit.py)."""
