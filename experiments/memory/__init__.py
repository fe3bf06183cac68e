"""Memory measurement: the dry-run meter, the CUDA caching-allocator replay, the GPU allowance beside live tensors
and the device's own statistics (docs/memory.md, docs/gpu-memory-model.md)."""
