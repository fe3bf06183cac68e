"""``hmt_core.optim.updaters``: the optimizer picks one updater per slot when it is built, from the slot's kind and
``method.mode`` parsed once into ``Mode``; no code in ``hmt_core/optim`` compares the mode's letter."""

import re
from pathlib import Path

import pytest

from helpers import tiny_llama
from hmt_core import hmt
from hmt_core.hmt_config import optimizer_settings
from hmt_core.optim.settings import Mode
from hmt_core.optim.updaters import ApolloScaling, Dense8bitAdam, DenseAdam, LowRankAdam

OPTIM = Path(__file__).resolve().parent.parent / "hmt_core" / "optim"


@pytest.mark.parametrize("mode,projected,dense", [("A", LowRankAdam, DenseAdam), ("B", ApolloScaling, DenseAdam),
                                                  ("B", ApolloScaling, Dense8bitAdam)])
def test_each_slot_gets_the_updater_of_its_kind(mode, projected, dense):
    dense_8bit = dense is Dense8bitAdam
    method = hmt.make(hmt.Config(mode=mode, rank=4, basis="random", dense_8bit=dense_8bit))
    method.attach(tiny_llama(), max_grad_norm=None)
    kinds = {(s.projected, type(s.updater)) for s in method.opt.slots}
    assert kinds == {(True, projected), (False, dense)}, kinds
    assert set(method.opt.dense8) == ({s.name for s in method.opt.slots if not s.projected} if dense_8bit else set())
    assert [s.updater.takes_low_rank_gradient for s in method.opt.slots if s.projected][0] == (mode == "A")


def test_the_mode_is_parsed_once_and_keeps_its_letter():
    rule = optimizer_settings(hmt.Config(mode="B")).rule
    assert rule.mode is Mode.APOLLO_SCALING and rule.mode == "B" and str(rule.mode) == "B"
    assert Mode("A") is Mode.LOW_RANK_ADAM
    with pytest.raises(ValueError, match=r"method.mode must be one of \('A', 'B'\), got 'C'"):
        hmt.Config(mode="C")


def test_no_optimizer_code_compares_the_mode_letter():
    letter = re.compile(r"""mode\s*[!=]=\s*["'][AB]["']|["'][AB]["']\s*[!=]=\s*\S*mode\b""")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(OPTIM.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if letter.search(line)]
    assert not found, "\n".join(found)
