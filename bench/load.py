"""``python -m bench.load``: the load generator (the console script ``tierserve-load``).

Its code lives in ``cluster/loadgen.py`` so that the installed package carries it; see that module
(or ``python -m bench.load --help``) for arrivals, tiers, lengths, bounds and the report.
"""

import sys

from cluster.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
