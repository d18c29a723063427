"""`python -m autotuner.lab worker ...`: one lab worker process (started by `Lab`)."""

import sys

from autotuner.lab.worker import worker_main

if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: python -m autotuner.lab worker ... (started by autotuner.lab.Lab)")
    worker_main(sys.argv[2:])
