"""`python -m kvindex.store.sqlite ...`: the SQLite store's writer process (writer.py)."""

import sys

from kvindex.store.sqlite.writer import writer_main

writer_main(sys.argv[1:])
