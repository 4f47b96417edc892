"""docpipe's inference engine for Qwen3.5-family vision-language models."""
