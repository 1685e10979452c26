"""Segment metadata: what a descriptor says, and where engines publish it.

- ``descriptor``: ``SegmentDesc`` (Mooncake's JSON plus flagcx_mc's own block);
- ``keys``: Mooncake's key layout in a metadata store;
- ``store``: the async store interface; ``http_store``, ``redis_store``, ``etcd_store`` the backends;
- ``connect``: a ``metadata_server`` argument to a store;
- ``server``: a Mooncake-compatible HTTP metadata server (``flagcx-mc metadata-server``).
"""
