"""The DeepSeek-V4 model: config parsing, layers, checkpoint loading, tokenizers, the built-in model."""
