"""`python -m hf_paged.serve MODEL ...`: the same as `hf-paged serve MODEL ...`."""

import sys

from .cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
