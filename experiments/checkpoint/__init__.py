"""Checkpoints: the on-disk store (atomic directory, manifest), the loop's manager (when to save, how to resume,
preemption) and multi-process checkpoints through torch.distributed.checkpoint."""
