"""GPU kernels (Triton). Each file holds `@triton.jit` kernels plus thin wrappers that
assert shapes and allocate outputs; a pure-torch reference sits beside every wrapper.
Importing needs Triton and a CUDA GPU; the CPU emulation never imports this package."""
