"""Entry point of //:cli (the `jaxkv` console script): `bazel run //:cli -- --help`.

A separate file rather than jaxkv/__main__.py, whose directory Python would put first on
sys.path when run as a script (shadowing top-level modules with jaxkv's own).
"""

from jaxkv._cli import run

if __name__ == "__main__":
    run()
