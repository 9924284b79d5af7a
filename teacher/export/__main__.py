"""`python -m teacher.export ...`: the same CLI as `distill-export`."""

import sys

from teacher.export import main

sys.exit(main())
