"""The pipeline: a request (:mod:`.request`), prompts to embeddings (:mod:`.tokenizer`, :mod:`.prompts`),
references and images (:mod:`.images`, :mod:`.inpaint`), the Euler sampler (:mod:`.sampling`), the
9B-KV reference cache (:mod:`.reference_kv`) and the engine that runs the stages (:mod:`.engine`)."""
