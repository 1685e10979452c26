"""Networking shared by the control plane and the metadata stores: ``host:port`` rules, bounded
asyncio listeners and the HTTP/1.1 exchange the metadata clients and server speak."""
