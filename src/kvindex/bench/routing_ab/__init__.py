"""`kvindex bench routing` (`python -m kvindex.bench --only routing_ab`): what routing by
kvindex is worth, against what a router's owner runs today.

A trace (the Mooncake format from a file, or the built-in shared-prefix generator:
`traces`) is replayed through modeled vLLM engines (bounded pools that evict as vLLM does,
a stated service-time model: `engines`) once per policy (`policies`) on a fresh fleet, the
same requests at the same times; the kvindex policies through a running `kvindex serve`
that follows the engines' real events and load streams, checked applied before every
decision (`replay`). Figures per policy (`figures`): prefix hit rate in tokens, modeled
time to first token p50/p90/p99, throughput, requests per engine, and for kvindex the
share of decisions equal to the oracle's at the same instant; a table and a plot.
"""
