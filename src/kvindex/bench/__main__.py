"""`python -m kvindex.bench`: the benchmark suite (see `kvindex.bench.suite`)."""

from kvindex.bench.suite import main

raise SystemExit(main())
