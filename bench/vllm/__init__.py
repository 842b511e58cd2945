"""Real vLLM engines on this machine: the virtualenv they run from (`install`), a tiny model
built without any hub (`tiny_model`), one engine process (`engine`) and a set of them wired
for NIXL prefill/decode handoffs (`fleet`)."""
