"""The scoring engines behind one port (``base.LogprobBackend``): transformers, vLLM, a remote
vLLM server, the deterministic fake and the paced benchmark engine, chosen by ``factory``;
plus the tokenizers and the ``dense`` strategy's sentence encoder."""
