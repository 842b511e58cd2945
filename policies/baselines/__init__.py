"""Placement policies shipped as baselines: what the systems we compare with do."""
