"""distill-keygen: make CURVE key pairs for `transport.curve`.

    distill-keygen --out keys teacher student-a student-b

writes `keys/<name>.key` (public: give it to the other side) and `keys/<name>.key_secret` (keep it
on the host that uses it, mode 0600) for each name. The teacher's config names its own secret file
and a folder holding the public keys of the students it accepts; each student's config names its
own secret file and the teacher's public key:

    transport:            # teacher                       # student
      curve:                                              curve:
        secret_key: keys/teacher.key_secret                 secret_key: keys/student-a.key_secret
        authorized_keys: keys/students/                     server_key: keys/teacher.key
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def make_keys(out: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Create `<out>/<name>.key` and `<out>/<name>.key_secret`; refuses to overwrite."""
    import zmq.auth

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise FileExistsError(f"{public} or {secret} exists already: pick another name or folder")
    pub, sec = zmq.auth.create_certificates(str(d), name)
    os.chmod(sec, 0o600)
    return Path(pub), Path(sec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="distill-keygen", description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+", help="one key pair per name, e.g. teacher student-0")
    ap.add_argument("--out", default="keys", help="folder for the key files (default: keys)")
    args = ap.parse_args(argv)
    for name in args.names:
        if not name or "/" in name or name.startswith("."):
            print(f"distill-keygen: bad name {name!r}", file=sys.stderr)
            return 2
        try:
            pub, sec = make_keys(args.out, name)
        except FileExistsError as e:
            print(f"distill-keygen: {e}", file=sys.stderr)
            return 2
        print(f"{name}: public {pub}, secret {sec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
