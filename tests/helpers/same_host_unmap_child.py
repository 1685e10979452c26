"""Child of tests/test_same_host.py: same-host copies into a peer's shared mapping keep running
while the peer's region leaves its table and another thread keeps refreshing that table.  An
unmapping under a running copy kills this process (SIGSEGV); prints "ok" when it survives."""

import os
import threading
import time

from flagcx_mc import TransferEngine
from flagcx_mc.buffers import HostBuffer

SIZE = 256 << 20  # above the pool's chunk size: a dedicated memfd region per buffer
owner, user = TransferEngine(transport="same-host"), TransferEngine(transport="same-host")
assert owner.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert user.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = HostBuffer(SIZE)
assert user.register_memory(buf.addr, SIZE) == 0
name, sessions = owner.session_name, user._state.require_sessions()
for _cycle in range(3):
    target = owner.allocate_managed_buffer(SIZE + 4096)
    assert user.transfer_sync_write(name, buf.addr, target, 4096) == 0
    assert sessions.peek(name).peer.shared_regions >= 1
    stop = threading.Event()

    # Each cycle's threads are joined before the next cycle: the default arguments only say so.
    def writer(stop=stop, target=target):
        while not stop.is_set():
            user.transfer_sync_write(name, buf.addr, target, SIZE)  # fails once unregistered

    def refresher(stop=stop):
        while not stop.is_set():
            session = sessions.peek(name)
            if session is not None:
                user._run(sessions.refresh(name, session))

    threads = [threading.Thread(target=writer), threading.Thread(target=refresher)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # The pool refuses unregister_memory; the core's unregister runs off the owner's loop, as
    # unregister_memory does for other memory, so the loop keeps answering refreshes meanwhile.
    gone = threading.Event()
    def unregister(target=target, gone=gone):
        owner._state.require_core().unregister(target)
        gone.set()

    threading.Thread(target=unregister).start()
    assert gone.wait(30)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(30)
user.close()
owner.close()
buf.close()
print("ok", flush=True)
os._exit(0)  # past CPython's exit-time leaks, which a sanitized run (tests/asan) would count
