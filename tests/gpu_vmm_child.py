"""Child of tests/test_gpu.py: a target engine whose GPU region comes from torch's expandable
segments (cuMemCreate / VMM memory, which CUDA IPC handles cannot export).

Prints {"session", "addr", "rc"} and then, on each line from stdin, the sha256 of the region."""

import hashlib
import json
import os
import sys

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch  # noqa: E402

from flagcx_mc import TransferEngine  # noqa: E402

size = int(sys.argv[1])
region = torch.zeros(size, dtype=torch.uint8, device="cuda")
engine = TransferEngine(transfer_timeout=30.0)
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
rc = engine.register_memory(region.data_ptr(), size, "cuda:0")
print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": region.data_ptr(), "rc": rc}), flush=True)
for _ in sys.stdin:
    torch.cuda.synchronize()
    print(hashlib.sha256(region.cpu().numpy().tobytes()).hexdigest(), flush=True)
engine.close()
