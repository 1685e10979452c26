"""Code written for ``mooncake.engine.TransferEngine`` runs on flagcx_mc through an import alias.

Everything under "Mooncake code, unchanged" is written for Mooncake the way vLLM's
MooncakeConnector drives it: ``initialize(host, "P2PHANDSHAKE", protocol, device)``,
``get_rpc_port()`` for the session name, ``batch_register_memory`` for the KV caches, and a
thread pool of 10 calling ``batch_transfer_sync_write`` concurrently, checking ``ret != 0``.  The
only flagcx_mc-specific lines are the alias at the top and the ``close()`` calls at the end
(Mooncake frees its engine in the destructor).

    python examples/mooncake_alias_swap.py [--requests 40]
"""

from __future__ import annotations

import sys
import types


def alias_mooncake_to_flagcx_mc() -> None:
    """Make ``import mooncake.engine`` resolve to flagcx_mc, even where Mooncake is installed.

    A local stand-in for ``flagcx_mc.compat.install_mooncake_alias()``.
    """
    import flagcx_mc

    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = flagcx_mc.TransferEngine
    package = types.ModuleType("mooncake")
    package.__path__ = []  # a package, so that "mooncake.engine" is importable from it
    package.engine = engine
    sys.modules["mooncake"] = package
    sys.modules["mooncake.engine"] = engine


alias_mooncake_to_flagcx_mc()

# ----------------------------------------------------------------- Mooncake code, unchanged

import argparse  # noqa: E402
import ctypes  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from mooncake.engine import TransferEngine  # noqa: E402

NUM_LAYERS = 4
NUM_BLOCKS = 64
BLOCK_LEN = 16 << 10  # bytes of one block of one layer's K (or V) cache


class KVCaches:
    """Per layer a K and a V cache of NUM_BLOCKS blocks (stand-ins for GPU tensors)."""

    def __init__(self) -> None:
        self.tensors = [(ctypes.c_ubyte * (NUM_BLOCKS * BLOCK_LEN))() for _ in range(2 * NUM_LAYERS)]
        self.base_addrs = [ctypes.addressof(t) for t in self.tensors]

    def fill_random(self) -> None:
        for t in self.tensors:
            ctypes.memmove(ctypes.addressof(t), os.urandom(len(t)), len(t))

    def digest(self, block_ids) -> str:
        h = hashlib.sha256()
        for t in self.tensors:
            view = memoryview(t).cast("B")
            for b in block_ids:
                h.update(view[b * BLOCK_LEN:(b + 1) * BLOCK_LEN])
        return h.hexdigest()


class MooncakeWorker:
    """The engine calls of vLLM's MooncakeConnector worker, nothing else."""

    def __init__(self, hostname: str, protocol: str = "tcp") -> None:
        self.engine = TransferEngine()
        self.hostname = hostname
        ret = self.engine.initialize(self.hostname, "P2PHANDSHAKE", protocol, "")
        if ret != 0:
            raise RuntimeError("Mooncake Transfer Engine initialization failed.")
        self.rpc_port = self.engine.get_rpc_port()
        self.kv = KVCaches()

    @property
    def session(self) -> str:
        return f"{self.hostname}:{self.rpc_port}"

    def register_kv_caches(self) -> None:
        kv_data_ptrs = list(self.kv.base_addrs)
        kv_data_lens = [NUM_BLOCKS * BLOCK_LEN] * len(kv_data_ptrs)
        ret_value = self.engine.batch_register_memory(kv_data_ptrs, kv_data_lens)
        if ret_value != 0:
            raise RuntimeError("Mooncake batch memory registration failed.")

    def send_blocks(self, remote_session: str, remote_base_addrs, local_ids, remote_ids) -> None:
        """Coalesce runs contiguous on both sides, then one batch write per request."""
        src_ptrs, dst_ptrs, lengths = [], [], []
        runs = []
        for s, d in zip(local_ids, remote_ids, strict=True):
            if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        for local_base, remote_base in zip(self.kv.base_addrs, remote_base_addrs, strict=True):
            for s, d, n in runs:
                src_ptrs.append(local_base + s * BLOCK_LEN)
                dst_ptrs.append(remote_base + d * BLOCK_LEN)
                lengths.append(n * BLOCK_LEN)
        ret_value = self.engine.batch_transfer_sync_write(remote_session, src_ptrs, dst_ptrs, lengths)
        if ret_value != 0:
            raise RuntimeError(f"Error in batch_transfer_sync_write: {ret_value}")


def request_waves(num_requests: int, rng: random.Random):
    """Requests (prefill block ids -> decode block ids); within a wave, decode blocks are distinct."""
    waves, wave, free = [], [], []
    for _ in range(num_requests):
        n = rng.randint(1, 6)
        if len(free) < n:
            if wave:
                waves.append(wave)
            wave, free = [], rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
        start = rng.randrange(NUM_BLOCKS - n)
        local_ids = list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(NUM_BLOCKS), n)
        wave.append((local_ids, sorted(free[:n])))
        free = free[n:]
    return waves + [wave]


def main(num_requests: int) -> int:
    prefill = MooncakeWorker("127.0.0.1")
    decode = MooncakeWorker("127.0.0.1")
    try:
        prefill.register_kv_caches()
        decode.register_kv_caches()
        prefill.kv.fill_random()
        verified = 0
        with ThreadPoolExecutor(max_workers=10, thread_name_prefix="vllm-mooncake-sender") as pool:
            for wave in request_waves(num_requests, random.Random(0)):
                futures = [pool.submit(prefill.send_blocks, decode.session, decode.kv.base_addrs, src, dst)
                           for src, dst in wave]
                for future in futures:
                    future.result()
                for src, dst in wave:
                    if decode.kv.digest(dst) != prefill.kv.digest(src):
                        print(f"MISMATCH: prefill blocks {src} -> decode blocks {dst}", file=sys.stderr)
                        return 1
                    verified += 1
        print(f"{verified} requests pushed by 10 threads through mooncake.engine.TransferEngine "
              f"(= {type(prefill.engine).__module__}.{type(prefill.engine).__name__}): all verified by sha256")
        return 0 if verified == num_requests else 1
    finally:
        for worker in (prefill, decode):  # flagcx_mc extra: Mooncake frees its engine in the destructor
            worker.engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    sys.exit(main(parser.parse_args().requests))
