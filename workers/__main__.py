"""`python -m workers worker|beat|submit|status`: the queue commands without the rest of docpipe's CLI."""
from __future__ import annotations

import typer

from .cli import register

app = typer.Typer(help="docpipe queue workers (Celery + Redis)", no_args_is_help=True)
register(app)

if __name__ == "__main__":
    app()
