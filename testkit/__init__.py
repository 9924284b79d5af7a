"""Test and demo kit, not needed by a teacher or a student: models, tokenizers and datasets built
locally (`testkit.tiny`: no hub access) and a teacher without vLLM (`testkit.synthetic_teacher`:
real hidden states from a transformers forward pass, through the real Publisher or into a spool).
Used by the main job (scripts/e2e.py), the tests and the benchmarks."""
