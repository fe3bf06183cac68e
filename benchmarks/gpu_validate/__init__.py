"""``python -m benchmarks.gpu_validate``: prove the GPU path on one CUDA device in about ten minutes.

Nothing in the harness is exercised on CPU that only a GPU has: the CUDA allocator's and NVML's figures, PCIe
counters, compiled Triton kernels, BF16 tensor-core paths, GaLore's 8-bit optimizer, every tokens/s figure. This
command measures each of them once, on whatever GPU a session is lent, and writes the evidence:

- **smoke tests** (first): ``pytest -m cuda`` (``tests/test_cuda_smoke.py``): one real training step per method
  setting and per activation preset on a micro model, the meter's peak against the allocator's; failures are a
  ``MISS`` naming the tests, a pytest that does not finish an ``ERROR``;
- **memory**: every method (adamw, adamw 8-bit, qlora, galore, galore 8-bit, apollo, hmt, hmt +
  ``activation=hmt``, and the memory-minimal HMT setting) at 125M, seq 1024, through the normal runner
  (``experiments.run device=cuda``, results in the normal results store): the meter's peak
  (``summary.memory.tracker_peak_bytes``) against ``torch.cuda.max_memory_allocated`` (within 3 %: the meter is
  what every CPU and dry-run number rests on), and the
  dry run of the same settings (``mode=dryrun``) against the allocator (within 5 %: the dry run is how memory is
  predicted for 7B/13B without a GPU); reserved bytes and NVML's device "used" beside them;
- **kernels**: every Triton kernel compiled on CUDA against its PyTorch reference (codecs bit-identical, the fused
  low-rank update / projection / Adam within BF16/FP32 tolerance) and timed against the fallback;
- **throughput**: tokens/s and MFU (6·N·tokens/s over the device's dense BF16 peak) per method, step time relative
  to AdamW, the ``hmt`` activation policy's step time relative to ``full_ckpt`` (target ≤ 1×), and the basis
  refresh by randomized vs exact SVD on a 4096×11008 matrix;
- **traffic**: with HMT's bases offloaded to the host, the meter's host↔device bytes and NVML's PCIe counters
  are non-zero.

A miss is a row marked ``MISS``; the command still finishes, writes everything and exits 0 — it exits non-zero
only when something crashed (``ERROR``). Optional checks that would overrun ``--budget-s`` are recorded as
``SKIPPED`` with the reason. Modules: ``plan`` (what runs, in which order, the time budget), ``checks``
(verdicts, tolerances, MFU), ``orchestrate`` (plan → records through a backend), ``cuda_backend`` (the only part
that touches the GPU; why training runs are subprocesses by default is in its docstring), ``kernel_checks`` (the
CUDA worker), ``report`` (the JSON schema, markdown and console tables), ``cli``. The CPU-side logic is tested with
a fake backend in ``tests/test_gpu_validate.py``.
"""
