"""Private helpers for the test suite and the benchmark: not part of the public API."""
