"""tierserve's benchmarks and measurement tools: not part of the installed package (neither the
wheel nor the sdist ships them). Run each from the repository's root as ``python -m
benchmarks.NAME`` (``--help`` for its options); each imports tierserve as any client does, and
nothing of tierserve imports them. The load generator they build on is installed:
``tierserve-load`` (``tierserve.cluster.load``)."""
