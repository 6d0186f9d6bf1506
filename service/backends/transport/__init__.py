"""HTTP to engines that run elsewhere: the inference-server client, a generator behind an
OpenAI-compatible API, and the remote engine's own load."""
