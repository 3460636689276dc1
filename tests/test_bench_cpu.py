"""Smoke test of the CPU benchmark (``treeattn bench``): a tiny grid runs and writes its report."""

import json

import pytest

from treeattn.cli.bench_cpu import run_cpu_bench


def test_cpu_bench_tiny_grid(tmp_path):
    pytest.importorskip("matplotlib")
    methods = ["treeattn", "treeattn-paged", "sdpa-mask", "sdpa-gqa"]
    report = run_cpu_bench(dtypes=["fp32"], ts=(4,), prefixes=(0, 20), methods=methods, repeats=2, warmup=1,
                           peak_seconds=0.1, out_dir=tmp_path, name="tiny")
    rows = report["results"]
    assert {r["method"] for r in rows} == set(methods)
    for r in rows:  # every method ran and computed the same attention as treeattn
        assert r["median_ms"] > 0 and r["max_abs_diff"] < 1e-4, r
    assert json.loads((tmp_path / "tiny.json").read_text())["settings"]["T"] == [4]
    assert "| fp32 | 4 | 20 |" in (tmp_path / "tiny.md").read_text()
    assert (tmp_path / "tiny.png").stat().st_size > 0
