"""Smallest complete use of the async API: two engines (here in one process, for brevity), one
registered buffer each, a write and a read verified by checksum.

    python examples/quickstart.py
"""

import asyncio

from flagcx_mc import AsyncTransferEngine, HostBuffer


async def main() -> None:
    src, dst = HostBuffer(8 << 20), HostBuffer(8 << 20)
    async with AsyncTransferEngine() as prefill, AsyncTransferEngine() as decode:
        await prefill.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await decode.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        await prefill.register_memory(src.addr, src.size)
        await decode.register_memory(dst.addr, dst.size)

        # Decode publishes f"{host}:{rpc_port}" and its buffer addresses (vLLM does this over ZMQ).
        session = f"127.0.0.1:{await decode.get_rpc_port()}"
        digest = src.fill_random()
        blocks = 16
        block = src.size // blocks
        await prefill.batch_transfer_sync_write(
            session,
            [src.addr + i * block for i in range(blocks)],
            [dst.addr + i * block for i in range(blocks)],
            [block] * blocks,
        )
        assert dst.digest() == digest, "write corrupted"

        src.fill(0)
        await prefill.transfer_sync_read(session, src.addr, dst.addr, src.size)
        assert src.digest() == digest, "read corrupted"
        print(f"moved {src.size >> 20} MiB each way to {session}: verified")
    src.close()
    dst.close()


if __name__ == "__main__":
    asyncio.run(main())
