"""The decode worker: admission under a device budget, continuous batching, sampling, stops, aborts."""
