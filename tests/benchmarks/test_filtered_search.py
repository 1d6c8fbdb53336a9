"""benchmarks/memory.py's filtered search section on a few thousand facts: every filter's hits are
checked against the reference inside the section; here, that it runs and prints its table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import memory  # noqa: E402


def test_the_filtered_search_section_runs_and_reports_each_filter(capsys):
    assert memory.main(["--skip-search", "--skip-kv", "--skip-ingest", "--filtered-facts", "6000", "--queries", "2",
                        "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "MemoryService.search at 6,000 facts" in out
    for row in ("none", "category = c3 (10%)", "tags has rare (1%)", "created in the last 10%"):
        assert row in out
