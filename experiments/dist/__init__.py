"""Multi-process training: process groups, DDP/FSDP2 wrapping, start on the meta device, gradient communication,
launch checks and world-size-free optimizer state (docs/distributed-collectives.md, docs/fsdp2_meta_init.md)."""
