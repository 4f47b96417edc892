"""`docpipe serve`: added to the pipeline's typer CLI through the "docpipe.commands" entry-point group.

Secure by default: binds 127.0.0.1; binding any address that is not loopback needs API keys (DOCPIPE_API_KEYS),
or an explicit `--insecure` from an operator who has put something else in front of it.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from pipeline.settings import Settings


class BindRefused(Exception):
    """`docpipe serve` would expose an unauthenticated server to the network."""


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address (names are resolved; unresolvable -> False)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}  # an IPv4/IPv6 sockaddr starts with the host string
    return bool(addresses) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)


def check_bind(host: str, have_keys: bool, insecure: bool) -> None:
    if is_loopback(host) or have_keys or insecure:
        return
    raise BindRefused(
        f"refusing to serve on {host}: it is reachable from the network and no API keys are configured. "
        "Set DOCPIPE_API_KEYS (e.g. DOCPIPE_API_KEYS=$(openssl rand -hex 24)), bind 127.0.0.1, "
        "or pass --insecure if access is controlled some other way."
    )


def settings_problems(exc: Any) -> str:
    """A pydantic ValidationError as 'DOCPIPE_FIELD: message; ...', without the refused input values."""
    return "; ".join(f"DOCPIPE_{'.'.join(str(p) for p in err['loc']).upper()}: {err['msg']}" for err in exc.errors(
        include_input=False, include_url=False))


def server_options(host: str, port: int, log_level: str, settings: Settings) -> dict[str, Any]:
    """uvicorn's settings for `docpipe serve`. h11 pinned: httptools (picked by "auto" where installed) answers some
    malformed framings itself, with plain text, before the app can send its problem document; and our guarded h11
    protocol adds the header deadline and the connection cap (api/http_protocol.py), from `settings` like the
    keep-alive timeout. The loop stays "auto": uvloop where installed."""
    from .http_protocol import guarded_protocol

    return {"host": host, "port": port, "log_level": log_level, "server_header": False, "proxy_headers": False,
            "http": guarded_protocol(settings), "timeout_keep_alive": settings.api_keep_alive_timeout_s}


def serve(
    host: Annotated[Optional[str], typer.Option(help="Address to bind (default DOCPIPE_API_HOST, 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default DOCPIPE_API_PORT, 8000).")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback address without API keys.")]
    = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    workers: Annotated[int, typer.Option(min=1, help="API processes sharing the port (broker mode only).")] = 1,
) -> None:
    """Serve the REST API, the web UI (at /) and the OpenAI-compatible endpoint."""
    import uvicorn
    from pydantic import ValidationError

    from pipeline.settings import Settings

    from .app import create_app

    try:
        settings = Settings()
    except ValidationError as exc:  # each refused setting by name; values are left out (they may be secrets)
        typer.echo(f"docpipe serve: invalid settings: {settings_problems(exc)}", err=True)
        raise typer.Exit(2) from None
    bind_host = host or settings.api_host
    bind_port = port or settings.api_port
    try:
        check_bind(bind_host, bool(settings.api_keys), insecure)
    except BindRefused as exc:
        typer.echo(f"docpipe serve: {exc}", err=True)
        raise typer.Exit(2) from None
    if workers > 1 and settings.embedded:
        typer.echo("docpipe serve: --workers needs a broker (DOCPIPE_BROKER_URL): in embedded mode the jobs and the "
                   "model run inside the server process, so there is exactly one", err=True)
        raise typer.Exit(2)
    if insecure and not settings.api_keys and not is_loopback(bind_host):
        typer.echo(f"docpipe serve: WARNING: serving {bind_host} without API keys (--insecure)", err=True)
    mode = "embedded (jobs run in this process)" if settings.embedded else "broker (jobs go to Celery workers)"
    typer.echo(f"docpipe serve: http://{bind_host}:{bind_port}/  mode: {mode}  "
               f"auth: {'API keys' if settings.api_keys else 'none (loopback)'}"
               + (f"  processes: {workers}" if workers > 1 else ""))
    options = server_options(bind_host, bind_port, log_level, settings)
    if workers > 1:
        # Each process builds its own app from the same DOCPIPE_* environment. Uploads are CPU-bound Python
        # (one core per process). The API keys' request rates are shared (api.limits.SharedBuckets); job quotas
        # and each process's /metrics counters are per process.
        from .auth import key_id
        from .limits import SharedBuckets
        from .processes import Supervisor, bind_sockets

        try:
            sockets = bind_sockets(bind_host, bind_port, workers)
        except OSError as exc:
            typer.echo(f"docpipe serve: cannot listen on {bind_host}:{bind_port}: {exc.strerror or exc}", err=True)
            raise typer.Exit(1) from None
        buckets = SharedBuckets(key_id(e.key) for e in settings.api_key_entries())
        raise typer.Exit(Supervisor(options, sockets, workers, rate_buckets=buckets).run())
    else:
        uvicorn.run(create_app(settings), **options)


def register(app: typer.Typer) -> None:
    """Entry point of the "docpipe.commands" group: add our commands to the `docpipe` CLI."""
    app.command("serve")(serve)
