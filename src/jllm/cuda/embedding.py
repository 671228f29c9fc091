"""The token embedding on the GPU, looked up from the GGUF's own Q4_K blocks (issue 23).

The host's lookup (jllm.model.weights.Embedding) dequantizes a row with numpy, ~0.2 ms for a row it has not
cached, which a CUDA graph's decode step of ~1.8 ms waits for, and on the synthetic bench every step missed.
Here the table sits on the device in its block layout (jllm.cuda.q4_k, 1.03x the file's bytes; the output
matrix's own copy where the model ties the two), and a step's rows come from one kernel, with nothing for the
host to wait on. The values are bitwise the host's (tests/test_cuda_matvec.py), so the cache's contents and
every logit are unchanged.
"""

from __future__ import annotations

import torch

from jllm.cuda.q4_k import Q4KWeight, rows
from jllm.model.weights import check_ids


class DeviceEmbedding:
    """ids [T] int64 (host or device) -> their rows, float32 [T, D] on the device. Ids on the host are checked;
    ids already on the device (jllm's own, never a user's) are not, which would cost a synchronisation."""

    def __init__(self, weight: Q4KWeight):
        self.weight = weight
        self.rows, self.cols = weight.shape
        self.device = weight.qs.device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cpu" and ids.numel():
            check_ids(int(ids.min()), int(ids.max()), self.rows)
        return rows(self.weight, ids.reshape(-1).to(self.device, torch.int64).contiguous())

    def nbytes(self) -> int:
        return self.weight.nbytes()
