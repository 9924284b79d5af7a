"""Distillation student: `accelerate launch student.py --config configs/student_tiny.yaml`.

The run lives in student/train.py (the loop in student/loop.py); this file is only the entry point.
"""

from student.train import main

if __name__ == "__main__":
    main()
