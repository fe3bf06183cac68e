import os
from pathlib import Path

# Triton kernels run on CPU through Triton's interpreter. It must be chosen before anything imports triton
# (bitsandbytes and torch may import it), so it is set here, first; the "auto" kernel backend ignores it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_resume import finish, launch, losses  # noqa: E402

# HMT_TEST_THREADS=n runs the tests with n intra-op threads (to check that results do not depend on it). By default
# at most 2, and pytest-xdist's workers share the cores (2 cores, `-n 2`: 1 thread each; docs/testing.md)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
torch.set_num_threads(int(os.environ.get("HMT_TEST_THREADS") or 0) or max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with ``--dist loadgroup`` (the README's test command) each test is scheduled on its own,
    except groups, run whole by one worker: the tests of a module that use one of its module-scoped fixtures (a
    2-process gloo run, a multirun, the local Slurm ``test_slurm`` starts and stops) are one group, so the fixture
    is built once and torn down after its last user; a test that names its own ``xdist_group`` keeps that one."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        defs = [d for ds in item._fixtureinfo.name2fixturedefs.values() for d in ds]
        if any(d.scope in ("module", "class", "package") and d.baseid for d in defs):  # baseid "": pytest's own
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, use_cache=False)


@pytest.fixture(scope="session")
def micro_reference(tmp_path_factory) -> Path:
    """The run directory of one uninterrupted run of ``test_resume.MICRO`` (10 steps, no checkpoints) in a
    subprocess: the trajectory every kill/preemption-and-resume test must reproduce, launched once per session."""
    root = tmp_path_factory.mktemp("micro-reference")
    rc, out = finish(launch(root, "ref"))
    assert rc == 0, out
    assert len(losses(root / "ref")) == 10, losses(root / "ref")
    return root / "ref"
