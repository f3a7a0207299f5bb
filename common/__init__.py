"""Shared by router and worker: wire protocol, cost model, config, errors, logging."""
