"""The prefill worker: batches prompts, runs chunked prefill, builds layouts, samples first tokens."""
