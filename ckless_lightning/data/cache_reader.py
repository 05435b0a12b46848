"""Entry point of the node's batch-cache reader: ``python -m ckless_lightning.data.cache_reader ARGS``
(see :mod:`ckless_lightning.data.reader_process`; the node agent starts it)."""

import sys

from ckless_lightning.data.reader_process import run_reader_process

if __name__ == "__main__":
    sys.exit(run_reader_process())
