import os

import torch

# Triton kernels run through Triton's interpreter when there is no GPU. The variable must be set
# before any kernel is decorated, so it is set here, before the tests import minillm.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
