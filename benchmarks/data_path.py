"""The data path side by side on a local 3-node Ray cluster: eager (XTuner + LMDeploy)
vs routeplay's producer path vs the adopted-key path vs the physical limit, all measured
in one run. The same run as ``routeplay bench`` (which this calls):

    .venv/bin/python benchmarks/data_path.py [--quick] [--json PATH] [--runs N]
"""

from __future__ import annotations

import sys

from routeplay.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
