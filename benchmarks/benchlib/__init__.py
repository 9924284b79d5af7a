"""Parts of the benchmarks, imported by benchmarks/gpu_e2e.py, gpu_scale.py and quality.py (run
from benchmarks/: the folder of the script is on sys.path)."""
