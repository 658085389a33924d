import os

import pytest
import torch

# Triton kernels run through Triton's interpreter when there is no GPU. The variable must be set
# before any kernel is decorated, so it is set here, before the tests import minillm.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The real-browser test starts JupyterLab and Chromium: run by `make test-browser`, never by
# `make test` (CI). Not collected at all unless asked for, so it never shows up as a green skip.
collect_ignore = [] if os.environ.get("MINILLM_BROWSER_TEST") == "1" else ["test_browser.py"]


@pytest.fixture(scope="module")
def one_thread():
    """Small engine steps gain little from a second thread, and on a shared 2-core machine a
    descheduled OpenMP worker stalls every matmul; a module that uses this runs single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
