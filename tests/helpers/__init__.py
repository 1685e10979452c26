"""Scripts the tests start as child processes (``python tests/helpers/<name>.py``); a few also
export the parent's side of their protocol (``kv_peer_child.PeerProcess``).  Not test modules."""
