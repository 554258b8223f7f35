import os

import torch

# Two torch processes that each use every core slow each other down tens of times
# (docs/models.md); tests are small, one thread is plenty.
torch.set_num_threads(int(os.environ.get("POSINTERP_TEST_THREADS", "1")))
