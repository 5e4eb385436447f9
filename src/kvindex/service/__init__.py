"""`kvindex.service`: the HTTP API over a `kvindex.runtime.Fleet`, its dashboard and its
Prometheus metrics."""
