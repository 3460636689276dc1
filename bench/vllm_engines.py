"""What the vLLM benchmarks share: one engine per process, results written as JSON plus a Markdown table.

An engine needs its own process: treeattn's plugin decides at vLLM's start which class sits behind
``CPU_ATTN`` (``TREEATTN_VLLM``), so two attention backends cannot share one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def engine_env(treeattn: bool, **extra: str) -> dict[str, str]:
    return {**os.environ, "TREEATTN_VLLM": "1" if treeattn else "0", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **extra}


def run_engine(name: str, cmd: list[str], env: dict[str, str], out: Path) -> dict:
    """Run one engine's command (which writes JSON to ``out``); exit with its log's tail if it fails."""
    print(f"{name} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def write_results(prefix: str, results: dict, text: str) -> None:
    """``PREFIX.json`` (every number) and ``PREFIX.md`` (the table), then the table on stdout."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(results, indent=2))
    Path(f"{prefix}.md").write_text(text)
    print(text)
