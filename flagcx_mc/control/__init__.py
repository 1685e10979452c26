"""The control plane: everything said on the rpc port, and how a peer's name becomes a descriptor.

- ``codec``: sans-I/O P2PHANDSHAKE frames (u64 little-endian length, type byte, JSON);
- ``handshake``: the asyncio server on the rpc port and the one-shot client request;
- ``auth``: signed, replay-checked messages when a shared secret is set;
- ``local_segment``: this engine's descriptor and the handlers that answer peers;
- ``resolvers``: a peer's name to (host, rpc port, descriptor), by handshake or metadata store.
"""
