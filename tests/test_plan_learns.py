"""Plans that learn: the planner never offers Mode B (APOLLO-Mini's tensor scale) on a projected LM head — the
setting behind the Llama-3.1-8B plan's first-update jump (docs/head_update.md) — and the 8B plan's optimizer
setting lowers the next batch's loss on a CPU proxy of the 8B shape (full width 4,096 and vocabulary 128,256)."""

from __future__ import annotations

from experiments.planner import cli as plan_cli
from experiments.planner.space import Space, all_options


def test_no_option_projects_the_head_under_mode_b():
    options = all_options(Space())
    assert options and not [o for o in options if o.mode == "B" and o.head], "Mode B with a projected head offered"
    assert any(o.mode == "A" and o.head for o in options)  # Mode A's projected head stays offered


def test_the_8b_16gib_answer_leaves_the_head_to_adam(tmp_path):
    """Before the fix the answer was Mode B with lm_head projected (results/model_cards/capacity/plans/
    capacity-llama3.1-8b-s2048-16gib.yaml, the plan that diverged on the H200)."""
    rec = plan_cli.main(["model=llama3.1-8b", "budget_gib=16", "train.seq_len=2048", f"results_dir={tmp_path}"])
    opt = rec["choice"]["optimizer"]
    print(rec["choice"])
    assert rec["traces"] == 0  # answered from the committed cost table
    assert not (opt["mode"] == "B" and opt["head"]), opt
    assert opt["vocab"]["head_update"] != "in_loss", opt  # in_loss exists only for Mode B's projected head
