"""``python -m benchmarks.gpu_validate``: see ``benchmarks/gpu_validate/__init__.py``."""

import sys

from benchmarks.gpu_validate.cli import main

sys.exit(main())
