"""The scoring engines behind one port (``base.LogprobBackend``), chosen by ``factory``:
``engines/`` (transformers, vLLM, a remote vLLM or SGLang server, the engine socket),
``fakes/`` (the deterministic fake and the paced benchmark engine), ``tokenizers/``,
``scheduling/`` (batch planning, the cross-request scheduler), ``transport/`` (HTTP to remote
engines and generators) and ``encoders/`` (the ``dense`` strategy's sentence encoder)."""
