"""`--store redis://HOST:PORT/DB`: one fleet state shared by several `serve` replicas.

A module per role: the service's side (store.py) and the Subscriber that feeds it the
other replicas' batches (feed.py); the worker process (worker.py) that appends
(append.py), follows the shared logs (reader.py) and compacts them (compact.py); reading
a store back (load.py); and the key layout, encodings and Lua scripts (keys.py).
"""

from kvindex.store.redis.store import RedisStore, current_rows

__all__ = ["RedisStore", "current_rows"]
