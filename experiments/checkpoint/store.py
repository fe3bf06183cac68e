"""Checkpoints on disk: state in, state out, an atomic directory write, a manifest with SHA-256 per file,
keep-last-N, and "find the latest good one".

Layout: ``<root>/step-00000040/{model.pt, method.pt, loop.pt, manifest.json}``. ``manifest.json`` holds the step,
the caller's metadata (config, sizes) and, for every other file, its byte size and SHA-256.

Atomicity: a checkpoint is written into ``<root>/.tmp-step-...`` (each file fsync'ed, the manifest last), the
temp directory is fsync'ed and renamed to ``step-...`` in one ``os.rename``, then ``<root>`` is fsync'ed. A
process killed at any moment leaves either no ``step-...`` directory for that step or a complete one; leftover
temp directories are removed by the next save. Old checkpoints are pruned by renaming them to ``.trash-...``
first, so a kill during pruning never leaves a half-deleted ``step-...`` directory. A failed write (disk full,
unwritable directory) removes its temp directory and raises ``CheckpointWriteError``; earlier checkpoints are
untouched.

Loading verifies every file's size and checksum first (``CorruptCheckpoint`` names the file and the
mismatch); ``find_latest_good`` walks from the newest step down and returns the first checkpoint that verifies,
with the reasons the newer ones were rejected. Files are ``torch.save`` pickles and are loaded with
``weights_only=False`` (baseline optimizers such as galore-torch keep projector objects in their state): load
only checkpoints you wrote — the checksums detect damage, not tampering.

Model state (``model_state``): trainable parameters and buffers are stored whole; frozen parameters are not
stored at all (their delta against the initial weights is zero: a resumed run rebuilds them from the same seed
or ``model.path``) and are checked instead through a fingerprint (SHA-256 of their bytes). INT8 weights
(``hmt_core.int8_weights``) count as trainable: their codes and scales are stored (updated in place though not
``requires_grad``), their one-element phantom ``weight`` is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hmt_core import streaming
from hmt_core.int8_weights import is_phantom, trained_in_place

FORMAT = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    pass


class CorruptCheckpoint(CheckpointError):
    pass


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    step: int
    bytes_by_file: dict[str, int]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_file.values())


# ------------------------------------------------------------------------------------------------ file level
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ErrorRecordingFile:
    """A write-only file wrapper that keeps the first ``OSError``: torch.save reports a failed write (ENOSPC,
    EFBIG, EIO) only as an opaque RuntimeError, so the original error is re-raised from here."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_fsynced(path: Path, write) -> None:
    with open(path, "wb") as f:
        wrapped = _ErrorRecordingFile(f)
        try:
            write(wrapped)
        except RuntimeError:
            if wrapped.error is not None:
                raise wrapped.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` directory under ``root``, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def check_writable(root: Path) -> Path:
    """Create ``root`` and prove a file can be written there (fail before training, not at the first save)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".tmp-probe-{os.getpid()}"
        _write_fsynced(probe, lambda f: f.write(b"ok"))
        probe.unlink()
    except OSError as e:
        raise CheckpointWriteError(f"checkpoint directory {root} is not writable: {e.strerror or e}") from None
    return root


def save_checkpoint(root: Path, step: int, payload: dict[str, Any], *, meta: dict | None = None, keep: int = 0,
                    pause_after_first_file_s: float = 0.0) -> SavedCheckpoint:
    """Write ``payload`` (file stem -> object for ``torch.save``) as checkpoint ``step`` under ``root``.

    ``keep`` > 0 prunes all but the newest ``keep`` checkpoints afterwards. ``pause_after_first_file_s`` widens
    the window in which a test can kill the writer mid-checkpoint (0 in normal use).
    """
    root = Path(root)
    t0 = time.perf_counter()
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
        files: dict[str, dict] = {}
        for i, (stem, obj) in enumerate(payload.items()):
            path = tmp / f"{stem}.pt"
            _write_fsynced(path, lambda f, obj=obj: torch.save(obj, f))
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
            if i == 0 and pause_after_first_file_s > 0:
                time.sleep(pause_after_first_file_s)
        manifest = {"format": FORMAT, "step": int(step), "files": files, "meta": meta or {}}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        _write_fsynced(tmp / MANIFEST, lambda f: f.write(text))
        _fsync_dir(tmp)
        final = root / step_dir_name(step)
        if final.exists():  # the same step saved again (e.g. the final checkpoint of a resumed, finished run)
            _discard(root, final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = [p.name for _, p in list_checkpoints(root)] if root.is_dir() else []
        raise CheckpointWriteError(
            f"could not write checkpoint for step {step} under {root}: {e.strerror or e}"
            f" ({type(e).__name__}); earlier checkpoints are intact: {previous[:3] or 'none'}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        prune(root, keep)
    sizes = {name: info["bytes"] for name, info in files.items()}
    sizes[MANIFEST] = len(text)
    return SavedCheckpoint(final, int(step), sizes, time.perf_counter() - t0)


def _remove_leftovers(root: Path) -> None:
    """Temp directories of killed writers and a killed writability probe's file."""
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".trash-")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _discard(root: Path, path: Path) -> None:
    trash = root / f".trash-{path.name}-{os.getpid()}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the removed paths."""
    complete = [p for _, p in list_checkpoints(root) if (p / MANIFEST).exists()]
    removed = complete[keep:]
    for p in removed:
        _discard(Path(root), p)
    return removed


def verify(path: Path) -> dict:
    """The manifest of the checkpoint at ``path`` after checking every file's size and SHA-256."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: no {MANIFEST} (incomplete checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST}: {e}") from None
    if manifest.get("format") != FORMAT or "files" not in manifest:
        raise CorruptCheckpoint(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    for name, info in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CorruptCheckpoint(f"{path}: missing file {name}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CorruptCheckpoint(f"{path}: {name} has {size} bytes, manifest says {info['bytes']} (truncated?)")
        digest = sha256_file(f)
        if digest != info["sha256"]:
            raise CorruptCheckpoint(f"{path}: {name} sha256 {digest[:12]}… does not match the manifest's "
                                    f"{info['sha256'][:12]}… (corrupted)")
    return manifest


def find_latest_good(root: Path) -> tuple[Path | None, dict | None, list[str]]:
    """(path, manifest, problems): the newest checkpoint that verifies, and why newer ones were rejected."""
    problems = []
    for _, path in list_checkpoints(root):
        try:
            return path, verify(path), problems
        except CorruptCheckpoint as e:
            problems.append(str(e))
    return None, None, problems


def load_checkpoint(path: Path, map_location: torch.device | str = "cpu") -> tuple[dict, dict[str, Any]]:
    """(manifest, file stem -> object), after ``verify``."""
    manifest = verify(path)
    payload = {}
    for name in manifest["files"]:
        payload[name.removesuffix(".pt")] = torch.load(Path(path) / name, map_location=map_location,
                                                       weights_only=False)
    return manifest, payload


# --------------------------------------------------------------------------------------- state in, state out
def _stored(p: torch.Tensor) -> bool:
    """A parameter whose value training changes: trainable, or INT8 codes/scales (not a phantom weight)."""
    return trained_in_place(p) or (p.requires_grad and not is_phantom(p))


def frozen_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the frozen parameters."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad or trained_in_place(p):
            continue
        t = p.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_state(model: nn.Module) -> dict[str, Any]:
    """Trainable parameters and buffers (references: the caller writes them before the next update)."""
    return {
        "params": {n: streaming.readable(p) for n, p in model.named_parameters() if _stored(p)},  # streamed: host
        "buffers": {n: b.detach() for n, b in model.named_buffers()},
    }


@torch.no_grad()
def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = {n for n, p in params.items() if _stored(p)}
    if set(state["params"]) != trainable:
        diff = sorted(set(state["params"]) ^ trainable)
        raise CheckpointError(f"checkpoint's trainable parameters differ from the model's: {diff[:5]}")
    for name, value in state["params"].items():
        _copy_into(streaming.writable(params[name]), value, name)  # a streamed weight's host copy
    for name, value in state["buffers"].items():
        if name in buffers:
            _copy_into(buffers[name], value, name)


def _copy_into(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if target.shape != value.shape or target.dtype != value.dtype:
        raise CheckpointError(f"checkpoint tensor {name} is {value.dtype}{tuple(value.shape)}, the model's is "
                              f"{target.dtype}{tuple(target.shape)}")
    target.copy_(value)


def rng_state() -> dict[str, Any]:
    """The state of every random generator a run uses: Python, NumPy, torch CPU and every CUDA device."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
