"""docs/campaign's tables are what the committed runs give: the report (``analysis.report``), the ablation table
(``analysis.ablation``), the batch table (``analysis.batch``), the embedding-cost table (``analysis.embedding_cost``),
the horizon/statistics/larger-model tables (``analysis.retuned``) and the warmup-stable-decay horizons table
(``analysis.wsd``, with the row names findings.md's command gives), regenerated from results/ into a temporary
folder, match the committed files byte for byte (the figures are left out: their pixels depend on the font library,
and the report's own determinism test covers them)."""

from __future__ import annotations

from pathlib import Path

from analysis import ablation, batch, embedding_cost, report, retuned, wsd, wsd_bracket

REPO = Path(__file__).resolve().parent.parent
RESULTS, DOCS = REPO / "results", REPO / "docs" / "campaign"


def _differing(made: Path, committed: Path) -> list[str]:
    files = sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file() and p.suffix in (".md", ".tex"))
    assert files, f"nothing written under {made}"
    return [str(f) for f in files if not (committed / f).exists()
            or (made / f).read_bytes() != (committed / f).read_bytes()]


def test_report_tables_regenerate_byte_identical(tmp_path: Path) -> None:
    assert report.main([str(RESULTS / "campaign"), "--timing", str(RESULTS / "campaign-timing"), "--memory-results",
                        str(RESULTS / "paper_memory"), "--out", str(tmp_path), "--no-figures"]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


def test_ablation_and_batch_tables_regenerate_byte_identical(tmp_path: Path) -> None:
    assert ablation.main([str(RESULTS / "campaign-controls"), str(RESULTS / "campaign"), "--out",
                          str(tmp_path / "tables")]) == 0
    assert batch.main([str(RESULTS / "campaign-batch"), str(RESULTS / "campaign"), str(RESULTS / "campaign-controls"),
                       "--out", str(tmp_path)]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


def test_embedding_cost_table_regenerates_byte_identical(tmp_path: Path) -> None:
    assert embedding_cost.main([str(RESULTS / "campaign-embedding"), str(RESULTS / "campaign"), "--out",
                                str(tmp_path / "tables")]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


def test_horizon_statistics_and_larger_model_tables_regenerate_byte_identical(tmp_path: Path) -> None:
    assert retuned.main([str(RESULTS / "campaign-horizon"), str(RESULTS / "campaign-stats"), "--out",
                         str(tmp_path), "--larger", str(RESULTS / "campaign-30m")]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


# the --row-name arguments of findings.md item 12's command
WSD_ROW_NAMES = ("adamw=AdamW split (×64 dense)", "hmt: default=HMT default",
                 "hmt: memory-minimal=HMT memory-minimal (leanest)", "galore=GaLore rank 64", "apollo=APOLLO")


def test_wsd_horizons_table_regenerates_byte_identical(tmp_path: Path) -> None:
    names = [arg for name in WSD_ROW_NAMES for arg in ("--row-name", name)]
    assert wsd.main([str(RESULTS / "campaign-wsd-pair"), "--out", str(tmp_path), "--name", "wsd_pair_horizons",
                     *names]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


# the rows of the 4,800-step table with AdamW split at its trunk-preferred rate (campaign_wsd_tiny_retuned)
WSD_RETUNED_ROW_NAMES = ("adamw (lr 0.0003)=AdamW split (×64 dense), lr 3e-4",
                         "adamw (lr 0.001)=AdamW split (×64 dense), lr 1e-3",
                         "hmt: default (lr 0.003)=HMT default, lr 3e-3", "hmt: default (lr 0.01)=HMT default, lr 1e-2",
                         "hmt: memory-minimal=HMT memory-minimal (leanest)", "galore=GaLore rank 64", "apollo=APOLLO")


def test_wsd_rate_bracket_table_regenerates_byte_identical(tmp_path: Path) -> None:
    names = [arg for name in WSD_ROW_NAMES for arg in ("--row-name", name)]
    assert wsd_bracket.main([str(RESULTS / "campaign-wsd-pair"), str(RESULTS / "campaign-wsd-bracket"), "--out",
                             str(tmp_path), *names]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []


def test_wsd_retuned_table_regenerates_byte_identical(tmp_path: Path) -> None:
    names = [arg for name in WSD_RETUNED_ROW_NAMES for arg in ("--row-name", name)]
    assert wsd.main([str(RESULTS / "campaign-wsd-pair"), "--extra", str(RESULTS / "campaign-wsd-retuned"),
                     "--reference", "adamw (lr 0.0003)", "--horizon", "4800", "--out", str(tmp_path),
                     "--name", "wsd_retuned", *names]) == 0
    assert _differing(tmp_path / "tables", DOCS / "tables") == []
