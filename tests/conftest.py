"""The project's own tests: pytester for the plugin; one BLAS thread per xdist worker (`-n 2` on two
cores: oversubscribed threads made small ops ~6x slower here)."""

import os

import torch

pytest_plugins = ["pytester"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
