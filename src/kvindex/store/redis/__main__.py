"""`python -m kvindex.store.redis`: the Redis store's worker process (worker.py)."""

from kvindex.store.redis.worker import worker_main

worker_main()
