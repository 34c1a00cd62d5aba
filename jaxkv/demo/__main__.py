"""`python -m jaxkv.demo`: the disaggregated prefill/decode demonstration (see jaxkv.demo)."""

from jaxkv.demo._cli import run

if __name__ == "__main__":
    run()
