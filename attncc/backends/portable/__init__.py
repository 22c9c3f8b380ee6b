"""The portable backend: Triton kernels that run on any GPU Triton targets, and under the
Triton interpreter on the CPU."""
