"""Measuring over HTTP: the OpenAI load client, server processes, /metrics scrapes and vllm-bench JSON."""
