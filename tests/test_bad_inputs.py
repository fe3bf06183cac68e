"""A new user's bad inputs: each gets one ``error:`` line naming the culprit, a non-zero exit, no traceback, and
leaves what was written before intact. Most cases run the runner in-process (``main_with_config`` on a
Hydra-composed config, exactly what ``python -m experiments.run`` calls); a few go through a real subprocess
to prove the command line itself prints no traceback, and Ctrl-C is a real SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runner import CONF, MICRO

from experiments.data.corpus import build_corpus
from experiments.data.local_corpus import split_long_text
from experiments.execute import main_with_config

REPO = Path(__file__).resolve().parent.parent
PARAGRAPH = ("The committee met in the spring and spoke of roads, of harvests, of the long winter and of the "
             "taxes that every town must pay. ")


def book(n_paragraphs: int, seed: int = 0) -> str:
    """Plain English-like text with blank-line paragraph breaks (a small "book")."""
    words = PARAGRAPH.split()
    out = []
    for i in range(n_paragraphs):
        rot = (i * 7 + seed) % len(words)
        out.append(" ".join(words[rot:] + words[:rot]) + f" Chapter {i}.")
    return "\n\n".join(out)


def compose_run(results: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("run", overrides=[f"results_dir={results}", *MICRO, *overrides])
    return main_with_config(cfg)


@pytest.fixture
def results(tmp_path):
    """A results dir holding an earlier completed run, which no failure may touch."""
    old = tmp_path / "results" / "old"
    old.mkdir(parents=True)
    (old / "summary.json").write_text('{"val_loss": 1.0}')
    (old / "status").write_text("completed\n")
    return tmp_path / "results"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and ".cache" not in p.parts}


def assert_one_line_error(capsys, results: Path, overrides: list[str], *fragments: str) -> str:
    """Run; assert a non-zero exit, one ``error:`` line containing every fragment, nothing earlier changed."""
    before = snapshot(results)
    with pytest.raises(SystemExit) as exc:
        compose_run(results, *overrides)
    assert exc.value.code not in (0, None), exc.value.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in err, err
    assert snapshot(results) == before  # no new run directory, no file changed
    return lines[0]


# ---------------------------------------------------------------------------------------------- data files
def test_one_large_text_file_is_cut_into_pieces_with_a_validation_split(tmp_path):
    path = tmp_path / "book.txt"
    text = book(400)
    path.write_text(text)
    pieces = split_long_text(text, 16_000)
    assert len(pieces) >= -(-len(text) // 16_000) and max(map(len, pieces)) <= 16_000
    assert all(p.endswith(".") for p in pieces)  # cut at paragraph ends, never inside one
    corpus = build_corpus(path=str(path), text_field="text", val_fraction=0.05, vocab_size=512, seq_len=32,
                          batch_size=2, seed=0, cache_dir=str(tmp_path / "cache"), chunk_chars=16_000)
    assert corpus.stats["train_docs"] + corpus.stats["val_docs"] == len(pieces), corpus.stats
    assert corpus.stats["val_docs"] >= 1, corpus.stats
    assert corpus.stats["val_tokens"] >= 32


def test_two_documents_give_both_splits(tmp_path):
    (tmp_path / "a.txt").write_text(book(20))
    (tmp_path / "b.txt").write_text(book(20, seed=3))
    corpus = build_corpus(path=str(tmp_path), text_field="text", val_fraction=0.05, vocab_size=300, seq_len=16,
                          batch_size=2, seed=0, cache_dir=str(tmp_path / "cache"), chunk_chars=0)
    assert (corpus.stats["train_docs"], corpus.stats["val_docs"]) == (1, 1)


def test_one_file_corpus_trains_through_the_runner(results, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(book(400))
    summary = compose_run(results, f"data.path={path}", "train.steps=2", "train.warmup_steps=1",
                          "method=adamw", "run_id=book")
    assert summary["data"]["val_docs"] >= 1 and summary["val_loss"] is not None


@pytest.mark.parametrize("name, content, fragments", [
    ("empty.txt", b"", ["empty.txt", "no text"]),
    ("blob.txt", bytes(range(256)) * 4, ["blob.txt", "binary"]),
    ("latin1.txt", "caf\u00e9 au lait\n".encode("latin-1") * 50, ["latin1.txt", "not UTF-8", "offset 3"]),
    ("rows.jsonl", b'{"text": "a"}\n{"body": "b"}\n', ["rows.jsonl line 2", "data.text_field='text'"]),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', ["bad.jsonl line 2", "not JSON"]),
    ("null.jsonl", b'{"text": "a"}\n{"text": null}\n', ["null.jsonl line 2", "NoneType"]),
    ("short.txt", b"just one short line\n", ["1 document", "data.chunk_chars"]),
])
def test_bad_corpus_files(capsys, results, tmp_path, name, content, fragments):
    path = tmp_path / "corpus" / name
    path.parent.mkdir()
    path.write_bytes(content)
    assert_one_line_error(capsys, results, [f"data.path={path}", "train.steps=2"], *fragments)


def test_corpus_too_short_for_one_sequence(capsys, results, tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(book(6))
    assert_one_line_error(capsys, results, [f"data.path={path}", "train.seq_len=2048", "data.chunk_chars=300"],
                 "train.seq_len=2048", "tokens")


def test_years_outside_the_builtin_corpus(capsys, results):
    assert_one_line_error(capsys, results, ["data.min_year=3000"], "data.min_year", "1790")


# ------------------------------------------------------------------------------------------ run ids and keys
@pytest.mark.parametrize("run_id", ["../../x", "a/b/c", "..", ".hidden"])
def test_run_id_must_be_one_folder(capsys, results, run_id):
    assert_one_line_error(capsys, results, [f"run_id={run_id}"], f"run_id={run_id!r}")
    assert not (results.parent / "x").exists() and not (results / "a").exists()


def test_seq_len_beyond_the_models_positions(capsys, results):
    assert_one_line_error(capsys, results, ["train.seq_len=8192"], "train.seq_len=8192", "max_position_embeddings=4096")


def test_rank_larger_than_the_weights(capsys, results):
    assert_one_line_error(capsys, results, ["method=galore", "method.rank=128"], "method.rank=128", "min(out, in)=64")
    assert_one_line_error(capsys, results, ["method.rank=128"], "method.rank=128")


def test_kernel_choices_that_do_not_exist_or_do_not_apply(capsys, results):
    assert_one_line_error(capsys, results, ["method=adamw", "method.impl=apex"], "method.impl", "apex")
    assert_one_line_error(capsys, results, ["method=adamw", "method.eight_bit=true", "method.impl=foreach"],
                          "method.impl=foreach", "method.eight_bit")
    assert_one_line_error(capsys, results, ["mode=dryrun", "dryrun.device=tpu"], "dryrun.device", "tpu")


def test_target_patterns_matching_no_weight(capsys, results):
    assert_one_line_error(capsys, results, ["method.target_patterns=[nosuchlayer]"], "method.target_patterns", "nosuchlayer")


def test_warmup_longer_than_the_run_is_a_loud_warning(capsys, results):
    compose_run(results, "train.steps=2", "train.warmup_steps=20", "method=adamw", "run_id=w")
    err = capsys.readouterr().err
    assert "warning: train.warmup_steps=20 >= train.steps=2" in err, err


def test_wandb_online_without_a_key(capsys, results, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert_one_line_error(capsys, results, ["wandb.mode=online"], "wandb.mode=online", "WANDB_API_KEY")


def test_model_config_that_is_not_json(capsys, results, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    assert_one_line_error(capsys, results, [f"model.path={model_dir}"], str(model_dir / "config.json"))


# ------------------------------------------------------------------------------------------------ checkpoints
def test_resuming_with_another_method_names_the_differences(capsys, results):
    compose_run(results, "train.steps=2", "train.warmup_steps=1", "train.checkpoint_every=1", "run_id=r")
    (results / "r" / "status").write_text("failed\n")  # as if it had died: a rerun would resume
    assert_one_line_error(capsys, results, ["train.steps=2", "train.warmup_steps=1", "method=adamw", "run_id=r"],
                 "different configuration", "method: 'hmt' -> 'adamw'", "force=true")


def test_resume_from_a_missing_path(capsys, results, tmp_path):
    assert_one_line_error(capsys, results, [f"train.resume={tmp_path}/nope"], "train.resume=", "nope")


# --------------------------------------------------------------------------------------- the real command line
def cli(results: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [sys.executable, "-m", "experiments.run", f"results_dir={results}", *MICRO, *overrides]
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("overrides, fragment", [
    (["run_id=../../x"], "run_id='../../x'"),
    (["train.seq_len=8192"], "train.seq_len=8192"),
    (["method=nosuch"], "method"),
    (["mode=dryrun", "dryrun.gpu_arch=kepler"], "dryrun.gpu_arch"),
    (["mode=dryrun", "dryrun.reserve=tight"], "dryrun.reserve"),
])
def test_command_line_prints_one_line_and_no_traceback(results, overrides, fragment):
    before = snapshot(results)
    proc = cli(results, *overrides)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out
    assert fragment in out, out
    assert snapshot(results) == before


def test_ctrl_c_checkpoints_and_the_rerun_resumes(results):
    overrides = ["run_id=c", "method=adamw", "train.steps=100", "train.warmup_steps=1", "train.eval_every=1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "experiments.run", f"results_dir={results}", *MICRO, *overrides]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = results / "c" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err
    assert "interrupted (Ctrl-C) after step" in err and "the same command resumes" in err, err
    step = json.loads(metrics.read_text().splitlines()[-1])["step"] + 1
    assert (results / "c" / "checkpoints" / f"step-{step:08d}").is_dir(), list((results / "c").rglob("*"))
    rerun = cli(results, *overrides)  # the same command resumes, and says so
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming c at step {step} from" in rerun.stderr, rerun.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(100))


def test_rerun_says_why_it_starts_at_step_zero(results, capsys):
    run_dir = results / "z"
    run_dir.mkdir()
    (run_dir / "status").write_text("failed\n")
    compose_run(results, "train.steps=1", "train.warmup_steps=1", "method=adamw", "run_id=z")
    err = capsys.readouterr().err
    assert "starting z at step 0: its previous attempt ended 'failed' without a usable checkpoint" in err, err


# ------------------------------------------------------------------------- values refused at validation
@pytest.mark.parametrize("overrides, fragments", [
    (["model.num_kv_heads=3"], ["model.num_kv_heads=3", "divide model.num_heads=4"]),
    (["model.num_kv_heads=0"], ["model.num_kv_heads=0", "> 0"]),
    (["train.seq_len=1"], ["train.seq_len=1", ">= 2"]),
    (["mode=dryrun", "dryrun.gpu_sizes_gib=[-16,0]"], ["dryrun.gpu_sizes_gib=[-16, 0]", "> 0"]),
    (["model.vocab_size=100"], ["model.vocab_size=100", "below 257", "256 byte symbols"]),
    (["method=hmt", "method.head_update=in_loss"], ["method.head_update=in_loss", "method.mode=B"]),
    (["method=hmt", "method.mode=B", "method.basis=random", "method.rank=1", "method.head_update=in_loss",
      "train.grad_accum=2"], ["method.head_update=in_loss", "train.grad_accum=2"]),
    (["method=hmt", "method.mode=B", "method.basis=random", "method.rank=1", "method.head_update=in_loss",
      "train.fused_ce=false"], ["method.head_update=in_loss", "train.fused_ce=false"]),
    (["method=hmt", "method.mode=B", "method.basis=random", "method.rank=1", "method.head_update=in_loss",
      "method.target_patterns=[attn,mlp]"], ["method.head_update=in_loss", "lm_head in method.target_patterns"]),
])
def test_values_refused_before_start(capsys, results, overrides, fragments):
    assert_one_line_error(capsys, results, overrides, *fragments)


def test_a_byte_level_bpe_never_has_fewer_than_257_tokens(tmp_path):
    """Why model.vocab_size < 257 is refused: asked for 100 tokens, the trainer still keeps all 256 bytes + EOS."""
    from tokenizers import pre_tokenizers

    from experiments.data.corpus import MIN_BPE_VOCAB, train_tokenizer

    encoder = train_tokenizer([book(5)], 100, tmp_path / "bpe.json")
    assert encoder.vocab_size == MIN_BPE_VOCAB == len(pre_tokenizers.ByteLevel.alphabet()) + 1, encoder.vocab_size


def test_empty_results_dir_is_refused(capsys, results, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert_one_line_error(capsys, results, ["results_dir="], "results_dir=''", "current directory")
    assert list(cwd.iterdir()) == []


def test_cache_dir_that_is_a_file(capsys, results, tmp_path):
    blocker = tmp_path / "cache.txt"
    blocker.write_text("mine")
    assert_one_line_error(capsys, results, [f"data.cache_dir={blocker}"], f"data.cache_dir={blocker}", "is a file")
    assert_one_line_error(capsys, results, [f"data.cache_dir={blocker}/sub"], f"{blocker}, which is a file")
    assert blocker.read_text() == "mine"


def test_model_config_that_transformers_rejects(capsys, results, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 3, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 512}))
    assert_one_line_error(capsys, results, [f"model.path={model_dir}"], str(model_dir / "config.json"),
                          "not a multiple of the number of attention heads")


def test_small_vocab_in_a_config_only_model_dir(capsys, results, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 100}))
    assert_one_line_error(capsys, results, [f"model.path={model_dir}"], "config.json vocab_size=100", "below 257")


# ------------------------------------------------------------------------------------ runs that go wrong
def test_diverging_run_ends_in_one_line_and_keeps_its_checkpoints(capsys, results):
    before = snapshot(results)
    with pytest.raises(SystemExit) as exc:
        compose_run(results, "method.lr=1e6", "train.steps=40", "train.warmup_steps=0", "train.checkpoint_every=1",
                    "train.max_bad_steps=2", "run_id=d")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exc.value.code == 1 and len(lines) == 1 and "Traceback" not in err, (exc.value.code, err)
    assert "consecutive steps with a non-finite loss or gradient" in lines[0], lines[0]
    assert "train.max_bad_steps=2" in lines[0] and "last checkpoint: " + str(results / "d" / "checkpoints") in lines[0]
    run_dir = results / "d"
    assert (run_dir / "status").read_text() == "failed\n"
    assert "TooManyBadSteps" in (run_dir / "error.txt").read_text()  # the traceback is kept for a bug report
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()), "checkpoints were removed"
    assert {k: v for k, v in snapshot(results).items() if not k.startswith("d/")} == before


def test_completed_run_with_another_configuration_names_the_differences(capsys, results):
    compose_run(results, "train.steps=1", "train.warmup_steps=1", "run_id=done")
    capsys.readouterr()
    # the same configuration (progress is not part of it) is skipped as before
    assert compose_run(results, "train.steps=1", "train.warmup_steps=1", "run_id=done", "train.progress=true") is None
    assert "already completed" in capsys.readouterr().out
    assert_one_line_error(capsys, results, ["train.steps=1", "train.warmup_steps=1", "run_id=done", "method=adamw"],
                          "run_id=done already completed", "different configuration", "method: 'hmt' -> 'adamw'",
                          "force=true", "another run_id")
    assert_one_line_error(capsys, results, ["train.steps=2", "train.warmup_steps=1", "run_id=done"],
                          "train.steps: 1 -> 2")


def test_a_run_folder_in_use_is_refused_in_process(capsys, results):
    from experiments.results import RunLock

    with RunLock(results / "busy"):
        line = assert_one_line_error(capsys, results, ["run_id=busy"], "run_id=busy is in use by another process",
                                     f"pid {os.getpid()}")
    assert "another run_id" in line
    assert not (results / "busy").exists()  # released: the lock file and the folder it made are gone


def test_a_lock_file_left_by_a_killed_run_does_not_block(tmp_path):
    """kill -9 leaves ``.lock`` behind but the kernel drops its flock: the next run takes it, then removes it."""
    from experiments.results import RunLock

    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("999999\n")
    with RunLock(run_dir) as lock:
        assert lock.path.read_text() == f"{os.getpid()}\n"
    assert sorted(run_dir.iterdir()) == []  # the file is gone; the folder, which was there before, stays


def test_two_processes_with_one_run_id(results):
    """The second of two runs started with the same run_id is refused while the first runs; the first's folder
    holds only its own files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    common = ["run_id=same", "train.steps=100000", "train.warmup_steps=1", "train.eval_every=100000"]
    first = subprocess.Popen([sys.executable, "-m", "experiments.run", f"results_dir={results}", *MICRO, *common,
                              "method=hmt"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        metrics = results / "same" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # the first is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        config = (results / "same" / "config.yaml").read_text()
        second = cli(results, *common, "method=adamw")
        assert first.poll() is None, first.communicate()  # still running: the refusal is not its end
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=240)
    lines = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode != 0 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    assert f"run_id=same is in use by another process (pid {first.pid})" in lines[0], lines[0]
    assert (results / "same" / "config.yaml").read_text() == config  # still the first's (method: hmt)
    assert "name: hmt" in config and "adamw" not in config, config


# -------------------------------------------------------------------------------- command-line quoting
@pytest.mark.parametrize("override", ["data.path=~/my corpus", "data.path=/data/caf\u00e9"])
def test_unquoted_special_characters_get_a_quoting_hint(results, override):
    before = snapshot(results)
    proc = cli(results, override)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "LexerNoViableAltException" not in proc.stderr, proc.stderr
    key, value = override.split("=", 1)
    assert f"{override!r}" in lines[0] and f"'{key}=\"{value}\"'" in lines[0], lines[0]
    assert snapshot(results) == before


def test_the_quoting_the_hint_gives_works(capsys, results):
    """Hydra takes the double-quoted value whole (then ``data.path`` is checked, and found missing)."""
    assert_one_line_error(capsys, results, ['data.path="~/no such corpus \u00e9"'],
                          "data.path does not exist: ~/no such corpus \u00e9")
