"""The experiments' command lines (experiments/stagnation.py, experiments/error_growth.py): each
writes where --out says, leaves the committed results in docs/results alone, and reports progress
while it runs."""

from __future__ import annotations

import hashlib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import error_growth, stagnation  # noqa: E402

RESULTS = ROOT / "docs" / "results"
TINY = {
    stagnation: ["--increments", "40", "--copies", "4", "--steps", "20", "--seeds", "2"],
    error_growth: ["--rows", "4", "--max-exponent", "1.5", "--repeats", "1"],
}


def digests(names: list[str]) -> dict:
    """The SHA-256 of each of docs/results/<name> (None where absent)."""
    return {
        name: hashlib.sha256((RESULTS / name).read_bytes()).hexdigest()
        if (RESULTS / name).exists()
        else None
        for name in names
    }


@pytest.mark.parametrize(
    "experiment, written",
    [
        (stagnation, ["stagnation.md", "stagnation.png"]),
        (error_growth, ["error_growth.md", "error_growth.png"]),
    ],
    ids=["stagnation", "error_growth"],
)
def test_experiment_writes_into_out_and_leaves_docs_results_alone(experiment, written, tmp_path):
    committed = digests(written)
    out = tmp_path / "results"
    experiment.main([*TINY[experiment], "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    assert (out / written[1]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "![" in (out / written[0]).read_text()
    assert digests(written) == committed


@pytest.mark.parametrize(
    "experiment", [stagnation, error_growth], ids=["stagnation", "error_growth"]
)
def test_out_defaults_to_docs_results_and_help_says_so(experiment):
    p = experiment.parser()
    assert p.parse_args([]).out == RESULTS
    assert "docs/results" in " ".join(p.format_help().split())


def test_stagnation_prints_a_line_per_tenth_of_the_accumulation_and_per_configuration(
    tmp_path, capsys
):
    stagnation.main([*TINY[stagnation], "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    tenths = [line for line in lines if line.startswith("accumulation: ")]
    assert [line.split()[1] for line in tenths] == [f"{4 * k}/40" for k in range(1, 11)]
    # float32, nearest, kahan once; stochastic and stochastic_equal once per seed
    configurations = [line for line in lines if line.startswith("training [")]
    assert [line.split("]")[0] for line in configurations] == [
        f"training [{k}/7" for k in range(1, 8)
    ]
