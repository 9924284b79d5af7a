"""The untrained EAGLE-3 draft a trained one is compared with: same config, same draft vocabulary,
initial weights (drawn with `student.seed`, as training starts), exported in the layout vLLM serves.

    python -m student.eagle3.baseline --config run.yaml --out runs/draft-untrained [--set KEY=VALUE]

It reads the run file's `student` section exactly as `student.py` does (recipe eagle3, its
`teacher_model` and `eagle3` keys) and connects to nobody. Exit 0 with the folder's path on
stdout; 2 with one line on a bad config.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the run file the trained draft used")
    ap.add_argument("--out", required=True, help="folder to write the untrained draft into")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = ap.parse_args(argv)
    from distill.errors import ConfigError
    from student.config import load_student_config
    from student.eagle3.draft import build_draft, export_draft
    from student.errors import StudentError

    try:
        cfg = load_student_config(args.config, args.set)[0]
        if cfg.recipe != "eagle3":
            raise StudentError(
                f"student.recipe is {cfg.recipe!r} in {args.config}: an EAGLE-3 baseline needs eagle3"
            )
        draft, _, _ = build_draft(cfg)
        folder = export_draft(draft, args.out)
    except (ConfigError, StudentError) as e:
        print(f"eagle3.baseline error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
