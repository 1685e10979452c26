"""Command-line tools: ``flagcx-mc demo``, ``bench`` and ``metadata-server`` (``cli``)."""
