"""Teacher side: vLLM with the hidden-state connector, and `distill-teacher` (see README.md)."""
