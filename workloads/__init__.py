"""tpusim.workloads: what runs on the pod (model zoo, traces, parallelism, training and decode)."""
