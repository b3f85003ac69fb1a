"""Benchmarks: each prints one JSON object, with ratios measured side by side in one run; none asserts on time."""
