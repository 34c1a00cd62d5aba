"""`python -m jaxkv`: the block-op demonstration command (see jaxkv._cli)."""

from jaxkv import _cli

if __name__ == "__main__":
    __doc__ = _cli.__doc__  # what absl's --help prints above the flags
    _cli.run()
