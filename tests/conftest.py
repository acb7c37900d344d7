"""The project's own tests: pytester for the plugin; one BLAS thread per xdist worker (`-n 2` on two
cores: oversubscribed threads made small ops ~6x slower here)."""

import os
import tempfile

import pytest
import torch

pytest_plugins = ["pytester"]
os.environ["CDNA2_CACHE_DIR"] = tempfile.mkdtemp(prefix="cdna2-test-cache-")  # never the user's hash cache

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "no_kernel: a Triton-op test that launches no kernel on purpose (a table, a "
                                       "fallback to the reference), exempt from `kernels_launched`")


@pytest.fixture
def kernels_launched(request, monkeypatch):
    """Fails a test that launched no Triton kernel: every launcher falls back to the reference op on some dtype
    or shape, and a kernel test that silently took that path compared the reference with itself (a review forced
    every op to its fallback and the kernel tests still passed). Tests that mean it carry `no_kernel`."""
    from cdna2_engine.ops import triton as tri

    calls = []
    launch = tri._Launch.__call__

    def counted(self, name, grid, *args, **kwargs):
        calls.append(name)
        return launch(self, name, grid, *args, **kwargs)

    monkeypatch.setattr(tri._Launch, "__call__", counted)
    yield calls
    if not calls and request.node.get_closest_marker("no_kernel") is None:
        pytest.fail("no Triton kernel was launched: the op fell back to the reference, so the test compared the "
                    "reference with itself (mark the test no_kernel if that is its point)", pytrace=False)
