"""How each serving engine (vLLM, SGLang) is spoken to: leg bodies, handoff order, fields read
back."""
