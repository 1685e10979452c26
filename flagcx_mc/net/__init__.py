"""Networking shared by the control plane and the metadata stores: ``host:port`` rules, the
bounded asyncio server skeleton, and the asyncio glue under h11 for HTTP/1.1."""
