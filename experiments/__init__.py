"""The harness: Hydra runner, data, models, loop, meter, results store, sweeps and planners."""

import logging

# bitsandbytes (imported by galore-torch, apollo-torch and peft) logs at import, on CPUs with AVX512-BF16, that an
# optional Hub kernel package is missing and suggests installing it; the harness never fetches from the Hub and
# its CPU fallback is used, so the line is noise on every run's output.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
