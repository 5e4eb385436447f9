"""`--store sqlite:///PATH`: the service's side (store.py), its writer process (writer.py),
reading a store back (load.py), the file's schema and queries (schema.py), and who owns it
(owner.py)."""

from kvindex.store.sqlite.load import current_rows, load_database
from kvindex.store.sqlite.store import SQLiteStore
from kvindex.store.sqlite.writer import WriterOptions

__all__ = ["SQLiteStore", "WriterOptions", "current_rows", "load_database"]
