"""Every malformed input of the public functions gets a clear error (see ``tests/bad_inputs.py``).

The cases run in a subprocess: a crash there fails this test and names the case, instead of killing
the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bad_inputs import PARTNERS


def test_every_bad_input_gets_a_clear_error():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.bad_inputs"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1].get("done"), (
        f"the case runner died (exit {proc.returncode}) during {lines[-1]['case'] if lines else '?'}: {proc.stderr[-2000:]}")
    problems = []
    results = [r for r in lines if "result" in r]
    for r in results:
        if r["valid"]:
            if r["result"] != "ok":
                problems.append(f"{r['case']}: valid input was refused: {r.get('message')}")
            continue
        if r["result"] == "ok":
            problems.append(f"{r['case']}: bad input was silently accepted")
        elif r["result"] == "other":
            problems.append(f"{r['case']}: unclear {r['type']}: {r['message']}")
        elif not any(name in r["message"] for name in PARTNERS[r["argument"]]):
            problems.append(f"{r['case']}: the error does not name {r['argument']}: {r['message']}")
    assert len(results) > 150
    assert not problems, f"{len(problems)} of {len(results)} cases:\n" + "\n".join(problems)
