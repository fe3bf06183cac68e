"""The planner plans for learning before micro-batch: an efficient micro-batch (experiments.planner.efficiency), then
the least expected loss cost of its lossy choices (experiments.planner.prices, priced by the tuned campaign), then
energy and time."""

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from analysis.loss_prices import loss_prices
from experiments.planner.efficiency import Throughput, efficient_batch
from experiments.planner.milp import solve
from experiments.planner.problem import KEEP, Action, Option, Problem, Segment, predict
from experiments.planner.prices import PRICES_FILE, option_prices
from experiments.planner.space import OptChoice, Vocab

REPO = Path(__file__).resolve().parents[1]


def test_efficient_batch_is_the_fewest_sequences_within_the_slack():
    # R = 295 FLOP/byte, 2,048-token sequences, the largest fitting 10: time per token ∝ 1 + R/T, so b sequences keep
    # (1 + 295/20480) / (1 + 295/(2048 b)) of its throughput: b=2 0.9463, b=3 0.9679
    model = Throughput(seq_len=2048, ridge=295.0, slack=0.05)
    rel = [model.relative(b, 10) for b in (1, 2, 3, 10)]
    expected = [(1 + 295 / 20480) / (1 + 295 / (2048 * b)) for b in (1, 2, 3, 10)]
    assert rel == pytest.approx(expected, rel=1e-12), (rel, expected)
    assert efficient_batch(model, 10) == 3
    assert efficient_batch(Throughput(seq_len=2048, ridge=295.0, slack=0.0), 10) == 10  # no slack: the largest
    assert efficient_batch(Throughput(seq_len=128, ridge=295.0, slack=0.05), 64) == 26  # 128-token sequences: 25 keep 0.9486, 26 0.9517


def _instance(throughput: Throughput | None) -> Problem:
    """Bytes (GiB): reference 2 + 1·b; options "lossy" (+0, energy 0.1, 0.78 nats) and "lossless" (+4, energy 0.9,
    0 nats); component a: int8 −0.5·b (0.005 nats)."""
    return Problem(budget=10.0, base=(Segment(1, {"forward": 2.0}, {"forward": 1.0}),),
                   options=[Option("lossy", {"forward": 0.0}, energy=0.1, lossy=1, loss=0.78),
                            Option("lossless", {"forward": 4.0}, energy=0.9, loss=0.0)],
                   actions={"a": {KEEP: Action(), "int8": Action(per_seq={"forward": -0.5}, lossy=1, loss=0.005)}},
                   conditional=(), max_batch=64, throughput=throughput)


def _brute_force(prob: Problem, floor: int) -> tuple:
    """Every (b ≥ floor, option, action) that fits; the lexicographic best: least loss, most energy, most b."""
    best = None
    for b, opt, a in itertools.product(range(floor, prob.max_batch + 1), prob.options, prob.actions["a"]):
        if predict(prob, b, opt, {"a": a}, False)["forward"] > prob.budget + 1e-12:
            continue
        key = (opt.loss + prob.actions["a"][a].loss, -opt.energy, -b)
        if best is None or key < best[0]:
            best = (key, (b, opt.name, a))
    return best[1]


def test_the_memory_an_efficient_micro_batch_frees_goes_to_the_choice_that_costs_less_loss():
    # the largest micro-batch: lossy option, a coded: 2 + 0.5 b ≤ 10 → b = 16
    largest = solve(_instance(None))
    assert (largest.batch, largest.option.name, largest.actions["a"]) == (16, "lossy", "int8"), largest
    # sequences of 2,048 tokens and R = 295: 16 fit; 3 keep 0.9628 of their throughput (2: 0.9412 < 0.95)
    model = Throughput(seq_len=2048, ridge=295.0, slack=0.05)
    floor = efficient_batch(model, 16)
    sol = solve(_instance(model))
    got = (sol.batch, sol.option.name, sol.actions["a"])
    # lossless (+4) fits b ≥ floor: kept (no 0.005-nat codec) at 2 + 4 + b ≤ 10 → b = 4
    assert floor == 3 and got == (4, "lossless", KEEP), (floor, got)
    assert got == _brute_force(_instance(model), floor)
    assert sol.fit_batch == 16 and sol.loss == 0.0 and largest.loss == pytest.approx(0.785), (sol, largest)


def test_loss_prices_regenerate_from_the_committed_campaign():
    """results/loss_prices/loss_prices.json is what analysis.loss_prices computes from results/ today."""
    regenerated = loss_prices(Path("results/campaign"), Path("results/campaign-embedding"))
    committed = json.loads(PRICES_FILE.read_text())
    assert regenerated == committed, json.dumps(regenerated, indent=1)
    assert committed["prices"]["mode_b"]["differs"] and committed["prices"]["mode_b"]["delta_nats"] > 0.5


def test_option_prices_name_each_lossy_part():
    choice = OptChoice("B", "bf16", 0.0, False, True, "int8", Vocab("int8", "lazy_exact", "dense"))
    names = [p.name for p in option_prices(choice)]
    assert names == ["mode_b", "bf16_state", "dense_8bit", "int8_weights", "int8_tables", "lazy_exact"], names
    lossless = OptChoice("A", "fp32", 1 / 16, False, False, "bf16")
    assert option_prices(lossless) == []


@pytest.fixture(scope="module")
def plans_24gib(tmp_path_factory):
    """The 8B card's 24 GiB answer with the efficient micro-batch (the default) and with the largest (slack 0)."""
    out = {}
    for slack in (0.05, 0.0):
        folder = tmp_path_factory.mktemp(f"slack{slack}")
        cmd = [sys.executable, "-m", "experiments.plan", "model=llama3.1-8b", "budget_gib=24", "train.seq_len=2048",
               f"efficiency_slack={slack}", f"results_dir={folder}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[slack] = (proc.stdout, json.loads(next((folder / "plans").glob("*.json")).read_text()))
    return out


def test_the_8b_24gib_answer_costs_less_loss_than_the_largest_micro_batch(plans_24gib):
    (text, rec), (_, largest) = plans_24gib[0.05], plans_24gib[0.0]
    mine, theirs = rec["loss_cost"]["expected_nats"], largest["loss_cost"]["expected_nats"]
    kept = rec["micro_batch"]["relative_throughput"]
    assert mine < theirs and kept >= 0.95, (mine, theirs, kept, rec["choice"]["optimizer_label"],
                                            largest["choice"]["optimizer_label"])
    assert rec["choice"]["optimizer"]["mode"] == "A", rec["choice"]["optimizer_label"]
    assert "| expected loss cost | " in text and "retained gradient energy" in text, text


def test_a_setting_that_failed_the_learning_check_is_not_offered(tmp_path, monkeypatch, capsys):
    """A results/plan_learns row saying the 8B 16 GiB answer failed: the planner answers with another setting and
    names the one it did not offer."""
    from experiments.planner import cli as plan_cli
    from experiments.planner import learning

    args = ["model=llama3.1-8b", "budget_gib=16", "train.seq_len=2048"]
    first = plan_cli.main([*args, f"results_dir={tmp_path / 'a'}"])
    label, lr = first["choice"]["optimizer_label"], first["recipe"]["lr"]
    failed = tmp_path / "learns"
    failed.mkdir()
    (failed / "llama3.json").write_text(json.dumps({"row": {
        "card": "llama3.1-8b", "budget_gib": 16, "plan_label": label, "plan_lr": lr, "passes": False,
        "gap_to_hmt_default": 1.0, "max_loss_after_step0": 20.0, "step0_loss": 12.5}}))
    monkeypatch.setattr(learning, "LEARNS_DIR", failed)
    second = plan_cli.main([*args, f"results_dir={tmp_path / 'b'}"])
    assert second["choice"]["optimizer_label"] != label, second["choice"]
    assert second["not_offered"] == [label] and second["learning_check"] == {"checked": False}, second
    assert "| not offered | failed the learning check" in capsys.readouterr().out


def test_verification_settles_on_the_least_loss_choice_at_the_verified_micro_batch(monkeypatch):
    # the loop reached b = 4 with the leanest (lossy) choice verified; at b = 4 the lossless option is predicted to
    # fit too (2 + 4 + 4 = 10 GiB): it is traced once more and taken when its trace fits, else the lossy stays
    from experiments.planner import verified
    from experiments.planner.correct import Corrections

    prob = _instance(None)
    monkeypatch.setattr(verified, "corrected_problem", lambda *a, **k: prob)
    monkeypatch.setattr(verified, "failed_learning", lambda *a, **k: False)
    lossy = solve(dataclasses.replace(prob, fixed_batch=4, options=[prob.options[0]]))
    assert lossy.option.name == "lossy"
    for fits in (True, False):
        written, traced = [], []
        v = verified.Verifier(write=lambda sol: written.append(sol.option.name) or 10.0,
                              trace=lambda step: (traced.append(step["option"]) or {"run": step["option"]},
                                                  (9 if fits else 11) * 2**30),
                              step_budget=10.0)
        v.last = lossy
        sol, summary = verified.settle(SimpleNamespace(run=None), {"_budget": 10}, Corrections(), (lossy, {"run": "lossy"}), v,
                                       live_budget=10.0, scale=1.0, model=None, log=print)
        # a miss (11 GiB against 10) asks the next candidate to be predicted 1 GiB leaner: lossless with a coded (8 GiB
        # at b = 4), then nothing lossless is left under 7 GiB and the verified lossy choice stays
        assert traced == (["lossless"] if fits else ["lossless", "lossless"]), traced
        expected = ("lossless", ["lossless"]) if fits else ("lossy", ["lossless", "lossless", "lossy"])
        assert (sol.option.name, written) == expected, (fits, sol.option.name, written)
        assert summary == {"run": sol.option.name}
