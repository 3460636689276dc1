"""``treeattn check``: every backend, and on a CPU every native kernel path this CPU has, against the float64
reference; a wrong path fails the command."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from treeattn.backends.native import NativeBackend
from treeattn.backends.native.build import EXTENSION
from treeattn.cli.check import run_check

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")


def checked() -> tuple[int, str]:
    """``treeattn check``'s exit code and text (wide enough that a table row, a self-check's error message
    included, stays on one line)."""
    console = Console(record=True, width=2000)
    code = run_check("cpu", console)
    return code, console.export_text()


def test_check_names_every_native_path_and_the_default_per_dtype():
    code, text = checked()
    assert code == 0, text
    native = NativeBackend()
    table = text[text.index("native kernel paths on this CPU"):]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for isa in native.isas():  # its row: its status per dtype, "(default)" where that dtype runs it
        row = next(line for line in table.splitlines() if line.startswith(f"│ {isa} "))
        assert row.count("(default)") == sum(native.path(dtype) == isa for dtype in dtypes), row
        for dtype in dtypes:
            why = native.off(isa, dtype)
            assert (why or "ok") in row, row
    assert table.count("(default)") == len(dtypes)
    assert "FAIL" not in text


def test_check_fails_when_a_native_path_is_wrong(monkeypatch):
    """A path whose output is off by a little (the generic one, which every CPU has) fails the command."""
    run = NativeBackend._run

    def wrong(self, q, k, v, state, page_size, sm_scale, out, lse, sinks):
        run(self, q, k, v, state, page_size, sm_scale, out, lse, sinks)
        if state.isa == "generic":
            out.add_(0.1)

    monkeypatch.setattr(NativeBackend, "_run", wrong)
    code, text = checked()
    assert code == 1
    assert "FAIL" in text[text.index("native kernel paths on this CPU"):]
    assert "checks failed" in text


def test_check_prints_why_a_path_is_off_as_it_is(monkeypatch):
    """A path's reason (an exception's text, which may hold rich's markup brackets) is printed verbatim."""
    off = NativeBackend.off
    monkeypatch.setattr(NativeBackend, "off",
                        lambda self, isa, dtype: "it raised [/] [bold]x" if isa == "generic" else off(self, isa, dtype))
    code, text = checked()
    assert code == 0
    row = next(line for line in text.splitlines() if line.startswith("│ generic "))
    assert row.count("off: it raised [/] [bold]x") == 3
