"""Triton kernels (gfx90a wave64, Hopper, and the CPU interpreter)."""
