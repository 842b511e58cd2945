"""Traces: the trace model, loaders for public formats, workload matrices and prompt text."""
