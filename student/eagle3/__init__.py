"""The EAGLE-3 draft: `draft` (the model, its vocabulary maps, loss and vLLM export; the recipe
`student/recipes/eagle3.py` drives it), `baseline` (the untrained draft a run would start from:
`python -m student.eagle3.baseline`) and `evaluate` (acceptance in vLLM: `python -m
student.eagle3.evaluate`)."""
