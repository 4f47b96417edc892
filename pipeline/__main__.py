"""`python -m pipeline ...` is the `docpipe` command (useful before the package is installed)."""
from .cli import main

main()
