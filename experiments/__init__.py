"""Experiments: acceptance harnesses and one-off measurements. Not packaged; run from the
checkout."""
