"""A simulated vLLM worker process: HTTP surface, protocol, tokenizer, metrics and real-time
loop."""
