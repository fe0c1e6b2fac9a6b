"""Request-level serving (`tpusim serve`): a stream of requests (`workload.py`) served by
replicas that batch them iteration by iteration (`simulate.py`, a SimPy model of each replica's
scheduler, its paged KV cache and the router in front), each iteration timed by tpusim's own
decode and prefill step model through a cost model built from the engine (`costs.py`), and the
latency and throughput statistics of the result (`metrics.py`). The run of a `ServeRequest` is
`sim.runs.serve.run_serve`.
"""
