"""Code the test modules share: pytest plugins with fixtures (``servers``: redis-server, etcd and
free ports; ``netns``: hosts in network namespaces), loaded by tests/conftest.py, and plain
helpers (``layouts``).  Not test modules."""
