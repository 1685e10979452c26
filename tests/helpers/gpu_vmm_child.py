"""Child of tests/test_gpu.py: a target engine whose GPU region comes from torch's expandable
segments (cuMemCreate / VMM memory in 20 MiB chunks, which legacy CUDA IPC handles cannot export).

Prints {"session", "addr", "rc", "posix_fd"} (posix_fd: torch's chunks allow POSIX file descriptor
handles) and then, on each line from stdin, {"sha256" of the region, "served_in": payload bytes its
data server received}."""

import ctypes
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
types = ctypes.c_uint64(0)  # CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES; bit 0: POSIX file descriptor
ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(ctypes.byref(types), 14, ctypes.c_uint64(region.data_ptr()))
print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": region.data_ptr(), "rc": rc,
                  "posix_fd": bool(types.value & 1)}), flush=True)
for _ in sys.stdin:
    torch.cuda.synchronize()
    print(json.dumps({"sha256": hashlib.sha256(region.cpu().numpy().tobytes()).hexdigest(),
                      "served_in": engine.stats()["bytes_served_in"]}), flush=True)
engine.close()
