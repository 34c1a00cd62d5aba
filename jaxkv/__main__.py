"""`python -m jaxkv`: the block-op demonstration command (see jaxkv._cli)."""

from jaxkv._cli import run

run()
