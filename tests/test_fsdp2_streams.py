"""FSDP2 + HMT: the sharded engine's hook work leaves FSDP2's reduce-scatter stream
(``hmt_core.optim.sharded.off_reduce_scatter_stream``).

FSDP2 calls post-accumulate-grad hooks inside ``device_handle.stream(post_reduce_stream)``. On a CUDA gradient the
helper must, in this order: record an event on that (current) stream, make the default stream wait for it, mark
the gradient's storage as used by the default stream, then run the body with the default stream current. The
streams are recorded by stand-ins (no GPU here), on a fake CUDA tensor (the fake-CUDA tier: the CUDA build of
torch, docs/testing.md); the CPU path calls no stream API at all (the CPU suite). The real streams run in the CUDA
smoke tier; the hook's arithmetic is unchanged and covered by tests/test_fsdp2_hmt.py on CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hmt_core.optim.sharded import off_reduce_scatter_stream


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record_event(self):
        self.log.append(("record_event", self.name))
        return f"event on {self.name}"

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Stream) and other.name == self.name

    __hash__ = object.__hash__


@contextlib.contextmanager
def _recording_streams(*, side: str):
    """torch.cuda's stream API replaced by recorders: the current stream is ``side``, the default one "default"."""
    log, current = [], [side]
    streams = {name: _Stream(name, log) for name in {side, "default"}}

    @contextlib.contextmanager
    def stream(s):
        log.append(("enter", s.name))
        before, current[0] = current[0], s.name
        try:
            yield
        finally:
            current[0] = before

    patches = [(torch.cuda, "current_stream", lambda device=None: streams[current[0]]),
               (torch.cuda, "default_stream", lambda device=None: streams["default"]),
               (torch.cuda, "stream", stream),
               (torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s.name)))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield log, current
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _fake_cuda_grad():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4, 8, device="cuda")


@pytest.mark.fake_cuda
@pytest.mark.skipif(torch.version.cuda is None, reason="fake-CUDA tier: needs the CUDA build of torch")
def test_a_cuda_gradient_s_hook_work_runs_on_the_default_stream_after_the_reduce_scatter():
    grad = _fake_cuda_grad()
    with _recording_streams(side="reduce_scatter") as (log, current):
        with off_reduce_scatter_stream(grad):
            log.append(("body", current[0]))
        assert current[0] == "reduce_scatter"  # FSDP2's stream is current again after the hook
    expected = [("record_event", "reduce_scatter"), ("wait_event", "default", "event on reduce_scatter"),
                ("record_stream", "default"), ("enter", "default"), ("body", "default")]
    assert log == expected, log


@pytest.mark.fake_cuda
@pytest.mark.skipif(torch.version.cuda is None, reason="fake-CUDA tier: needs the CUDA build of torch")
def test_on_the_default_stream_already_nothing_is_synchronized():
    grad = _fake_cuda_grad()
    with _recording_streams(side="default") as (log, current):
        with off_reduce_scatter_stream(grad):
            log.append(("body", current[0]))
    assert log == [("body", "default")], log


def test_a_cpu_gradient_touches_no_stream_api():
    grad = torch.zeros(4, 8)
    with _recording_streams(side="reduce_scatter") as (log, current):
        with off_reduce_scatter_stream(grad):
            log.append(("body", current[0]))
    assert log == [("body", "reduce_scatter")], log
