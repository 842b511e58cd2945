"""Live replay: a trace's turns sent to an OpenAI-compatible endpoint, every chunk timed."""
