"""Step-through lessons over the public API (placeholder until the lessons issue)."""
