"""The engines behind ``LogprobBackend``: transformers in this process, vLLM's in-process engine,
a remote vLLM or SGLang server, and one engine process shared by the workers over a socket."""
