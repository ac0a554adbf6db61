"""Generated reports under reports/ are as their generator wrote them (bench_utils.write_report keeps the .md's
SHA-256 in its .json): a hand edit of a generated .md is found; notes go in NAME.notes.md."""

from __future__ import annotations

import glob
import json
import os

from sgl_jax.bench_utils import REPORT_SHA_KEY, generated_report_problem, write_report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_generated_report_is_as_written():
    reports = sorted(glob.glob(os.path.join(REPO, "reports", "**", "*.md"), recursive=True))
    assert reports
    problems = [p for p in map(generated_report_problem, reports) if p is not None]
    assert not problems, problems


def test_a_hand_edit_of_a_generated_report_is_found(tmp_path):
    md = str(tmp_path / "bench.md")
    json_path = write_report(md, "A benchmark", "python -m sgl_jax.bench_x", "| a | b |\n|---|---|\n| 1 | 2 |",
                             {"rows": [[1, 2]]})
    assert generated_report_problem(md) is None
    with open(md, "a") as f:
        f.write("\nA note added by hand.\n")
    assert "edited after it was generated" in generated_report_problem(md)
    with open(json_path) as f:
        raw = json.load(f)
    del raw[REPORT_SHA_KEY]
    with open(json_path, "w") as f:
        json.dump(raw, f)
    assert f"has no {REPORT_SHA_KEY}" in generated_report_problem(md)
    os.remove(json_path)
    assert "is missing" in generated_report_problem(md)
    hand_written = tmp_path / "notes.md"
    hand_written.write_text("# Notes\n\nWritten by hand.\n")
    assert generated_report_problem(str(hand_written)) is None
