import contextlib

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation (and stalls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "announce(text): a line printed when the test starts (long, silent tests)")


def pytest_runtest_setup(item):
    """Say what a long test is doing before the progress line goes quiet for minutes."""
    marker = item.get_closest_marker("announce")
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if marker is not None and reporter is not None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():  # setup output is captured
            reporter.write_line(f"\n[{item.nodeid}] {marker.args[0]}")
