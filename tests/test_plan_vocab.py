"""The planner's vocabulary-memory choices (INT8 embedding and LM head, row updates of the embedding, the head updated
in the loss) and the layer-input codecs under full layer recomputation (``experiments.planner.vocab``, docs/planner.md).

What is proven: every option the planner can emit for a run is accepted by the app itself (HMT's ``Config``, the
``RunConfig`` and the method attached to the model), for runs that admit all of them and for runs that admit none
(tied embeddings, no fused loss, gradient accumulation, per_layer=false); a choice space the app cannot satisfy and
bad choice keys end in one ``error:`` line; the MILP honours "a layer-input codec only under layer recomputation";
on a tiny model with a large vocabulary the planner picks the row update, and the INT8 tables with it, when only
they fit, writes them into the plan config, and the plan's full dry run fits; and costs traced at 1 and 2 layers predict
the 4-layer traces of the new choices within the planner's 1%.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from experiments import methods
from experiments.dist.parallel import build_sharded
from experiments.planner import cli as plan_cli
from experiments.planner import plan as planner
from experiments.planner.costs import GIB, derive, layer_variants, policy_for, trace_sample
from experiments.planner.milp import leanest, solve
from experiments.planner.problem import KEEP, Action, Option, Problem, Segment, predict
from experiments.planner.model import build_problem
from experiments.planner.space import DEFAULT_VOCAB, Space, Vocab, all_options
from experiments.planner.vocab import admissible, model_facts, refusal

ALL_VOCAB = ["embedding_updates=[dense,lazy_exact,sparse_adam]", "layer_inputs=[keep,int8,fp8,int4_outlier]"]


def _emitted(overrides: list[str], space: Space):
    run = planner.run_config(overrides)
    with layer_variants(run) as with_layers:
        facts = model_facts(run, with_layers)
    return run, facts, all_options(space, admissible(space, run, facts))


def _attach(run, choice) -> None:
    """What the app does with a plan's method settings: HMT's Config (its checks), the RunConfig (its checks), the
    model prepared and the method attached (the model's checks)."""
    method = dataclasses.replace(run.method, **choice.method_changes(run.method))
    run = dataclasses.replace(run, method=method)
    m = methods.make_method(run.method)
    model = build_sharded(run.model, m, None, vocab_size=None, device=torch.device("cpu"))
    m.attach(model, max_grad_norm=run.train.max_grad_norm or None)


@pytest.mark.parametrize("extra, offered", [
    ([], True),  # untied tiny model, fused loss, one micro-batch: every vocabulary setting
    (["model.tie_embeddings=true"], False),
    (["train.fused_ce=false"], "no in_loss"),
    (["train.grad_accum=2"], "no in_loss"),
    (["method.per_layer=false"], "dense updates"),
])
def test_every_emitted_option_is_accepted_by_the_app(extra, offered):
    """Each distinct (mode, head, 8-bit, vocabulary) option the planner can emit attaches to the model through the
    app's own checks; what it leaves out, the app refuses (so the filter is needed, not merely cautious)."""
    space = Space(**{k: planner.parse_args(ALL_VOCAB)[0][k] for k in ("embedding_updates", "layer_inputs")},
                  state_budgets=(0.25,), state_dtypes=("bf16",), weight_dtypes=("bf16",),
                  mode_b_head=True)  # Mode B's projected head (asked for): the one setting in_loss needs
    run, facts, options = _emitted(["model=tiny", "model.num_layers=1", "train.seq_len=32", *extra], space)
    kinds = {(o.mode, o.head, o.dense_8bit, o.vocab) for o in options}
    for mode, head, eight, vocab in sorted(kinds):
        _attach(run, next(o for o in options if (o.mode, o.head, o.dense_8bit, o.vocab) == (mode, head, eight, vocab)))
    for codec in space.layer_inputs:  # the activation policy's own checks, as the plan writes it
        policy_for(run.activation, True, layer_recompute=True, residual=codec)
    vocabs = {v for *_, v in kinds}
    left_out = [Vocab(d, u, h) for d in space.embedding_dtypes for u in space.embedding_updates
                for h in space.head_updates if Vocab(d, u, h) not in vocabs]
    for v in left_out:  # Mode B, projected head, 8-bit: where every setting could be offered
        choice = next(o for o in all_options(space) if o.mode == "B" and o.head)
        choice = dataclasses.replace(choice, vocab=v)
        assert refusal(run, choice, facts), v
        with pytest.raises(ValueError):
            _attach(run, choice)
    if offered is True:
        assert len(vocabs) == 12 and not left_out, sorted(vocabs)
    elif offered is False:
        assert vocabs == {DEFAULT_VOCAB}, sorted(vocabs)
    elif offered == "no in_loss":
        assert all(v.head_update == "dense" for v in vocabs) and len(vocabs) == 6, sorted(vocabs)
    else:  # the row update and the in-loss head both update inside backward, per layer
        assert {(v.embedding_update, v.head_update) for v in vocabs} == {("dense", "dense")}, sorted(vocabs)
        assert len(vocabs) == 2, sorted(vocabs)


@pytest.mark.parametrize("argv, fragments", [
    (["embedding_updates=[dense,sparse]"], ["embedding_updates=", "'sparse'", "lazy_exact"]),
    (["layer_inputs=[keep,recompute]"], ["layer_inputs=", "'recompute'"]),
    (["head_updates=[]"], ["head_updates must list at least one choice"]),
    (["model.tie_embeddings=true", "embedding_dtypes=[int8]"], ["embedding_dtypes=[", "ties its input embedding"]),
])
def test_bad_vocabulary_choices_are_one_line(capsys, tmp_path, argv, fragments):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["model=tiny", "model.num_layers=1", "train.seq_len=32", "budget_gib=2", *argv,
                       f"results_dir={tmp_path}"])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(f in lines[0] for f in fragments), lines[0]


def test_milp_layer_codec_only_with_layer_recomputation():
    """Reference 1 + 1·b GiB (backward); layer recomputation −0.5·b (1 s/seq), its INT8 inputs −0.25·b more (lossy,
    0.1 s/seq); component a: int8 −0.6·b (lossy). Budget 4: a's int8 alone fits b ≤ 7, recomputation alone b ≤ 6,
    recomputation with coded inputs b ≤ 12 — the optimum. At b = 6 without a's codec recomputation alone is the
    faster, lossless choice, unless keeping the inputs is not offered (``layer_keep=False``); a codec never comes
    without recomputation."""
    prob = Problem(budget=4.0, base=(Segment(1, {"backward": 1.0}, {"backward": 1.0}),),
                   options=[Option("o", {"backward": 0.0})],
                   actions={"a": {KEEP: Action(), "int8": Action(per_seq={"backward": -0.6}, lossy=1)}},
                   layer_recompute=Action(per_seq={"backward": -0.5}, time=1.0), layer_components=("a",),
                   layer_codecs={"int8": Action(per_seq={"backward": -0.25}, time=0.1, lossy=1)}, max_batch=64)
    sol = solve(prob)
    assert (sol.batch, sol.layer_recompute, sol.layer_codec) == (12, True, "int8"), sol
    assert sol.policy_actions()["residual"] == "int8" and sol.predicted["backward"] == pytest.approx(4.0)
    six = dataclasses.replace(prob, actions={"a": {KEEP: Action()}}, max_batch=6)
    assert (lambda s: (s.batch, s.layer_recompute, s.layer_codec))(solve(six)) == (6, True, KEEP)
    forced = solve(dataclasses.replace(six, layer_keep=False))
    assert (forced.batch, forced.layer_recompute, forced.layer_codec) == (6, True, "int8"), forced
    free = solve(dataclasses.replace(six, budget=100.0, layer_keep=False))  # no recomputation needed: no codec
    assert (free.batch, free.layer_recompute, free.layer_codec) == (6, False, KEEP), free
    assert "residual" not in free.policy_actions() or free.policy_actions()["residual"] == KEEP


# ---- a tiny model with a large vocabulary, planned ------------------------------------------------------------------
# 16,384 × 256: the vocabulary matrices are 8 MiB each, the embedding's dense gradient and AdamW moments 24 MiB; the
# head stays dense (Mode B's projected head on this shape is outside what 2-layer lines predict, for the default
# vocabulary as much: docs/planner.md), so the row update and the layer-input codec are the new choices in play.
MODEL = ["model=tiny", "model.num_layers=2", "model.vocab_size=16384", "train.seq_len=64", "dryrun.reserve=flat",
         "dryrun.cuda_context_gib=0"]
SPACE = ["modes=[B]", "state_dtypes=[bf16]", "weight_dtypes=[bf16]", "dense_8bit=[false]", "project_head=[false]",
         "actions=[keep]", "layer_recompute=[false,true]", "layer_inputs=[keep,int8]", "embedding_dtypes=[bf16,int8]",
         "embedding_updates=[dense,lazy_exact]", "head_updates=[dense]", "max_batch_size=4"]
CAL = {"device": "test", "flops_per_s": 1e11, "bytes_per_s": 1e10, "codec_s_per_byte": {"int8": 1e-9}}


@pytest.fixture(scope="module")
def costs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    (root / "cal.json").write_text(json.dumps(CAL))
    keys = {**planner.parse_args(SPACE)[0], "calibration": str(root / "cal.json"), "workers": 1}
    run = planner.run_config([*MODEL, f"results_dir={root / 'results'}"])
    return root, planner.prepare(run, keys, log=lambda _: None)


def _problem(prep, layers: int | None = None, budget: float = 1.0):
    return build_problem(derive(prep.record, layers), space=prep.space, record=prep.record, stats=prep.stats,
                         flops=prep.flops, cal=CAL, budget_gib=budget, llama=True)


def _peak(predicted: dict) -> float:
    return max(v for v in predicted.values() if v is not None)


def test_int8_tables_and_row_updates_are_chosen_when_only_they_fit(costs):
    """At 4 sequences (here the optimizer phase binds: the embedding's dense gradient and moments), budgets between
    the leanest predicted peaks of the vocabulary settings: between the default and the row update, the planner
    takes the row update and keeps the tables BF16 (lossless first); between BF16 and INT8 tables with rows, it must
    take both. The tighter plan is written with their overrides and its full dry run fits."""
    root, prep = costs
    prob = dataclasses.replace(_problem(prep), fixed_batch=4)

    def lean(vocab: Vocab) -> float:
        options = [o for o in prob.options if o.payload.vocab == vocab]
        return _peak(leanest(dataclasses.replace(prob, options=options)).predicted)

    rows, int8_rows = Vocab("bf16", "lazy_exact"), Vocab("int8", "lazy_exact")
    ladder = [lean(v) for v in (DEFAULT_VOCAB, Vocab("int8"), rows, int8_rows)]
    assert ladder[0] > ladder[2] > ladder[3] and ladder[1] > ladder[2], ladder  # GiB
    loose = solve(dataclasses.replace(prob, budget=(ladder[0] + max(ladder[1], ladder[2])) / 2))
    assert loose.option.payload.vocab == rows, (loose.option.name, ladder)
    budget = (ladder[2] + ladder[3]) / 2  # GiB: the step's share (dryrun.cuda_context_gib=0)
    rec = plan_cli.main([*MODEL, *SPACE, f"budget_gib={budget:.6f}", "batch_size=4", "verify=true",
                        f"results_dir={root / 'results'}", f"calibration={root / 'cal.json'}", "name=v", "workers=1"])
    assert rec["choice"]["optimizer"]["vocab"] == dataclasses.asdict(int8_rows), (rec["choice"], ladder, budget)
    nodes = yaml.safe_load((root / "results" / "plans" / "v.yaml").read_text())
    assert (nodes["method"]["embedding_dtype"], nodes["method"]["embedding_update"]) == ("int8", "lazy_exact")
    if rec["choice"]["layer_recompute"]:
        assert nodes["activation"]["residual"] == rec["choice"]["layer_codec"]
    assert rec["verified"]["fits"], (rec["verified"], budget)
    assert "INT8 embedding and lm_head, embedding updated by its touched rows" in plan_cli.render_plan(rec)


def test_two_layer_costs_predict_four_layer_peaks_of_the_new_choices(costs):
    """Every option (vocabulary setting) with layer recomputation keeping its inputs, and the last (INT8 tables with
    rows) also coding them, predicted at 4 layers from the 1- and 2-layer traces, against a 4-layer trace at b = 2. Tolerance 1% of the peak, the
    planner's own (tests/test_plan.py): byte counts are exact on both sides, the slack is for events interleaving
    differently at another depth; the deltas of the vocabulary settings and the codec must add to the rest."""
    _, prep = costs
    prob = _problem(prep, 4)
    deep = planner.run_config([*MODEL, "model.num_layers=4", "train.batch_size=2"])
    keep = {c: KEEP for c in prob.actions}
    checked = []
    for option in prob.options:  # every vocabulary setting; the codec with the last (INT8 tables, rows)
        for codec in (KEEP, "int8") if option is prob.options[-1] else (KEEP,):
            predicted = _peak(predict(prob, 2, option, keep, True, codec))
            method = dataclasses.replace(deep.method, **option.payload.method_changes(deep.method))
            policy = policy_for(deep.activation, True, layer_recompute=True, residual=codec)
            s = trace_sample(dataclasses.replace(deep, method=method, activation=policy))
            measured = max(s["peak"], s["probe"] or 0) / GIB
            checked.append((option.payload.vocab.key, codec, predicted, measured))
    assert {v for v, *_ in checked} == {"bf16:dense:dense", "bf16:lazy_exact:dense", "int8:dense:dense",
                                        "int8:lazy_exact:dense"}, checked
    assert checked[-1][:2] == ("int8:lazy_exact:dense", "int8"), checked
    bad = [c for c in checked if abs(c[2] - c[3]) > 0.01 * c[3]]
    assert not bad, bad



def test_oom_replan_keeps_the_runs_vocabulary_and_layer_codec():
    """After an out-of-memory error the planner re-solves among the choices the checkpoint resumes with: the run's
    vocabulary settings are its optimizer option (their state must load), its layer-input codec may stay or go but
    no new one comes, and a changed codec is written as ``activation.residual``."""
    from experiments.planner import oom
    from experiments.planner.problem import Solution

    run = planner.run_config(["model=tiny", "model.num_layers=1", "train.seq_len=32", "method.mode=B",
                              "method.basis=random", "method.scaling=tensor", "method.rank=1", "method.scale=128",
                              "method.state_budget=null", "method.state_dtype=bf16",
                              "method.target_patterns=[attn,mlp,lm_head]", "method.embedding_dtype=int8",
                              "method.embedding_update=lazy_exact", "method.head_update=in_loss",
                              "activation=full_ckpt", "activation.residual=int8"])
    choice = oom.current_choice(run)
    assert choice.vocab == Vocab("int8", "lazy_exact", "in_loss") and choice.head, choice
    space = oom.resumable_space(run, choice)
    assert (space.embedding_dtypes, space.embedding_updates, space.head_updates) == (
        ("int8",), ("lazy_exact",), ("in_loss",)), space
    assert space.layer_inputs == ("keep", "int8"), space
    option = Option(choice.label(), {}, payload=choice)
    sol = Solution(run.train.batch_size, option, {c: KEEP for c in ("residual", "norm")}, True, {}, 0.0, 0.0, 0)
    assert oom._overrides(run, sol, True) == {"activation.residual": "keep"}, oom._overrides(run, sol, True)
