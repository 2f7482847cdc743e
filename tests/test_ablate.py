"""`enlace ablate`: the ablation file, fitting a run to the budget, the table; and the shipped files."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import tiny_config
from test_train_stages import project  # noqa: F401  (the fixture: a project folder with a byte corpus)

from enlace import peak
from enlace.ablate.fit import Calibration, fitted_steps, schedule_overrides, step_seconds
from enlace.ablate.runner import Selection, close_to_baseline
from enlace.ablate.spec import FITTED, load_spec
from enlace.ablate.table import markdown, rows, write_into
from enlace.cli import main
from enlace.config.checks import check_train
from enlace.errors import ConfigError, EnlaceError

ROOT = Path(__file__).resolve().parents[1]
SPEC = "name: t\nbudget_s: 60\nvariants:\n  baseline: []\n  muon: [train.optimizer.name=muon]\n"


def spec_file(tmp_path, text):
    p = tmp_path / "a.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "path", sorted((ROOT / "configs" / "ablations").glob("*.yaml")), ids=lambda p: p.name
)
def test_shipped_ablation_files_resolve_every_variant(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = load_spec(path)
    assert spec.name == path.stem
    sel = Selection("params.yaml", {}, [])
    baseline = sel.config(spec, spec.variants["baseline"]).train.optimizer.name
    for variant, overrides in spec.variants.items():
        cfg = sel.config(spec, overrides)  # validates every override against the config models
        # A variant named for Muon trains with it; any other keeps the baseline's optimizer (a file's `set`
        # pins it, or it is the default recipe's on this CPU kind).
        assert cfg.train.optimizer.name == ("muon" if "muon" in variant else baseline)


@pytest.mark.parametrize(
    "text,field,words",
    [
        (SPEC.replace("  baseline: []\n", ""), "ablation", "must include 'baseline'"),
        (SPEC + "  Bad Name: []\n", "ablation", "variant name 'Bad Name'"),
        (SPEC + "  x: [train.max_steps=10]\n", "ablation", "train.max_steps is set by the harness"),
        (SPEC + "  y: [train.seed=3]\n", "ablation", "train.seed is set by the harness"),
        (SPEC + "  z: [optimizer]\n", "ablation", "is not section.key=value"),
        (SPEC.replace("budget_s: 60", "budget_s: 0"), "budget_s", "greater than 0"),
        (SPEC + "seeds: [1, 1]\n", "seeds", "seeds repeat"),
        (SPEC + "colour: blue\n", "colour", "Extra inputs"),
    ],
)
def test_bad_ablation_file_is_one_line_naming_the_field(tmp_path, text, field, words):
    p = spec_file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_spec(p)
    assert e.value.source == str(p) and e.value.field == field and words in e.value.message


def test_bad_ablation_file_exits_2_before_training(tmp_path, capsys):
    p = spec_file(tmp_path, SPEC.replace("  baseline: []\n", ""))
    assert main(["ablate", str(p), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {p}: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_step_time_skips_the_first_interval():
    records = [
        {"step": 1, "loss": 5.0, "tokens_per_s": 10.0},  # start-up and compilation
        {"step": 5, "loss": 4.0, "tokens_per_s": 1000.0},
        {"step": 10, "loss": 3.0, "tokens_per_s": 800.0},
        {"step": 15, "loss": 3.0, "tokens_per_s": 1200.0},
        {"step": 15, "val_loss": 3.0},
    ]
    assert step_seconds(records, tokens_per_step=2000) == pytest.approx(2.0)
    with pytest.raises(EnlaceError, match="too few steps"):
        step_seconds(records[:1], 2000)


def test_fitted_run_fills_the_budget_and_decays_inside_it():
    cal = Calibration(steps=40, wall_s=50.0, step_s=0.5)  # 30 s of start-up
    assert cal.overhead_s == pytest.approx(30.0)
    steps = fitted_steps(600, cal, fill=0.95)
    assert steps == int((570 - 30) / 0.5)
    t = tiny_config(
        {"train.max_steps": 2800, "train.schedule.warmup_steps": 100, "train.schedule.decay_steps": 840}
    ).train
    over = schedule_overrides(t, steps)
    assert set(over) <= set(FITTED)
    assert over["train.max_steps"] == steps and over["train.schedule.decay_steps"] == round(0.3 * steps)
    assert over["train.schedule.warmup_steps"] == 100
    # The fitted config is valid: warmup + decay fit in max_steps even when the budget is tight.
    short = schedule_overrides(t, 120)
    assert short["train.schedule.warmup_steps"] + short["train.schedule.decay_steps"] <= 120
    fitted = tiny_config({"train.max_steps": 2800, **short})
    check_train(fitted)
    with pytest.raises(EnlaceError, match="raise budget_s"):
        fitted_steps(20, cal, fill=0.95)


def result(runs):
    machine = {"cpu": "X", "isa": "AVX512", "dtype": "bf16", "threads": 2, "torch": "2.13"}
    machine |= {"load_average_1min": 1.0, "load_average_1min_end": 1.5}
    return {"command": "enlace ablate a.yaml", "budget_s": 60.0, "machine": machine, "runs": runs}


def run_row(variant, seed, prose, val, stopped=False):
    r = {"variant": variant, "seed": seed, "steps": 100, "tokens": 204800, "prose_bpb": prose}
    choices = {"pairs_acc": 0.6 + seed / 100, "continuations_acc": 0.3}  # seeds 1 and 2: mean 0.615
    return r | {"val_bpb": val, **choices, "mfu": 0.2, "stopped_at_budget": stopped}


def test_rows_average_seeds_and_compare_with_the_baseline():
    r = result(
        [
            run_row("baseline", 1, 2.0, 1.8),
            run_row("muon", 1, 1.99, 1.7),
            run_row("baseline", 2, 2.2, 1.8),
            run_row("muon", 2, 2.09, 1.7, stopped=True),
        ]
    )
    base, muon = rows(r)
    assert (
        base["seeds"] == [1, 2]
        and base["prose_bpb"] == pytest.approx(2.1)
        and base["prose_bpb_change"] is None
    )
    assert muon["prose_bpb"] == pytest.approx(2.04) and muon["prose_bpb_change"] == pytest.approx(
        2.04 / 2.1 - 1
    )
    assert muon["val_bpb_change"] == pytest.approx(1.7 / 1.8 - 1) and muon["stopped_at_budget"]
    md = markdown(r)
    assert "`enlace ablate a.yaml`" in md and "X (AVX512, bf16" in md
    assert (
        "| muon (stopped at the budget) | 1, 2 | 100 | 204,800 | 2.0400 | -2.86% | 1.7000 | -5.56% | 0.615 | 0.300 "
        "| 20.0% |" in md
    )


def test_table_replaces_its_own_block_in_the_page(tmp_path):
    page = tmp_path / "ablations.md"
    page.write_text("# Ablations\n\nmethod\n")
    write_into(page, "muon", "table one")
    write_into(page, "other", "table two")
    write_into(page, "muon", "table three")
    text = page.read_text()
    assert text.startswith("# Ablations\n\nmethod\n")
    assert "table one" not in text and text.count("<!-- ablation:muon -->") == 1
    assert text.index("table three") < text.index("table two")


def test_second_seed_goes_to_variants_within_the_threshold():
    prose = {"baseline": 2.00, "muon": 1.985, "worse": 2.05, "better": 1.90, "same": 2.0}
    assert close_to_baseline(prose, 0.01) == ["muon", "same"]
    assert close_to_baseline(prose, 0.0) == []


@pytest.mark.slow  # about a minute on 2 busy cores (pytest --durations)
@pytest.mark.usefixtures("project")
def test_ablate_end_to_end_on_a_tiny_model(capsys, monkeypatch):
    """Two variants of a tiny byte-level run through the real command: calibration, fitted runs in their
    own processes, scoring, the table and results.json, and the table written into a page."""
    root = Path.cwd()
    # The MFU reference from its smallest shape only: the full set is ~1 TFLOP, 15 s of a 2-core AVX2 CPU.
    monkeypatch.setattr(peak, "PEAK_SHAPES", peak.PEAK_SHAPES[:1])
    tiny = [
        "model.d_model=32", "model.n_layer=2", "model.seq_len=32", "model.ffn_multiple_of=16",
        "hardware.num_threads=1", "hardware.compile=false", "train.micro_batch_size=4",
        "train.grad_accum_steps=1", "train.global_batch_size=4", "train.eval_batches=2",
        # The steps are fitted to the clock: on a quiet machine they outrun the tiny corpus's data budget.
        "data.max_epochs=1000",
    ]  # fmt: skip
    spec = {
        "name": "tiny",
        "stage": "smoke",
        # Most of it start-up (a fresh process imports torch and checks the data); what is left still fits
        # well over the 10 steps the fit requires.
        "budget_s": 20.0,
        "seeds": [7, 8],
        "second_seed_below": 0.0,  # no second seed: the decision has its own test above
        "calibration_steps": 10,
        "set": tiny,
        "variants": {"baseline": [], "muon": ["train.optimizer.name=muon"]},
    }
    (root / "t.yaml").write_text(yaml.safe_dump(spec))
    (root / "docs").mkdir()
    (root / "docs" / "ablations.md").write_text("# Ablations\n")
    assert main(["ablate", "t.yaml", "--docs", "docs/ablations.md"]) == 0
    out = capsys.readouterr().out
    result = json.loads((root / "runs/ablate/tiny/results.json").read_text())
    assert [(r["variant"], r["seed"]) for r in result["runs"]] == [("baseline", 7), ("muon", 7)]
    for r in result["runs"]:
        assert r["steps"] >= 10 and r["tokens"] == r["steps"] * 4 * 32
        assert r["prose_bpb"] > 0 and r["val_bpb"] > 0 and 0 < r["mfu"] <= 1
        cfg = json.loads((root / f"runs/ablate/tiny/{r['variant']}-s7/config.json").read_text())["config"]
        assert cfg["train"]["seed"] == 7 and cfg["train"]["max_steps"] == r["planned_steps"]
        assert cfg["train"]["optimizer"]["name"] == ("muon" if r["variant"] == "muon" else "adamw")
        assert cfg["model"]["d_model"] == 32  # the file's `set` reached the run
    assert not (root / "runs/ablate/tiny/.calibrate/baseline").exists()  # scratch removed
    table = (root / "runs/ablate/tiny/table.md").read_text()
    assert "| muon" in table and "`enlace ablate t.yaml --docs docs/ablations.md`" in table
    assert table in out and "<!-- ablation:tiny -->" in (root / "docs/ablations.md").read_text()
