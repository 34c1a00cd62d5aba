"""`python -m jaxkv.demo`: the disaggregated prefill/decode demonstration (see jaxkv.demo)."""

from jaxkv.demo import _cli

if __name__ == "__main__":
    __doc__ = _cli.__doc__  # what absl's --help prints above the flags
    _cli.run()
