"""Distillation student: `accelerate launch student.py --config configs/student_tiny.yaml`.

The loop lives in student/train.py; this file is only the entry point.
"""

from student.train import main

if __name__ == "__main__":
    main()
