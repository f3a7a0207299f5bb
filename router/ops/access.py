"""Who may talk to the router: the API key, the Host check against DNS rebinding, and CORS.

``AccessPolicy`` is pure: it takes header values and answers. ``access_middleware`` applies
it to every request before any handler runs; ``add_cors_headers`` runs as the app's
``on_response_prepare`` signal, so streamed responses and error responses carry the same
CORS headers as the rest.

- The API key, when set, guards everything but a few open paths (``/health``,
  ``/metrics``, ``/openapi.json``, and the status page: ``/``, ``/status``, ``/static/*``):
  deny by default, so a route added later is guarded without anyone remembering to.
  Keys are compared in constant time.
- The Host check refuses a request whose Host header names another server. A web page
  that rebinds its own DNS name to 127.0.0.1 reaches a loopback port with its own name in
  Host; without this check it could drive the API from the user's browser.
- A browser request from a page of another origin is refused unless that exact origin
  was given with ``--cors-origin``; so is a preflight. This also stops "simple" cross-site
  POSTs (``text/plain`` bodies need no preflight) from spending the GPU.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import stat
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from common.config import RouterConfig
from common.errors import ConfigError, HeadroomError, HostNotAllowed, OriginNotAllowed, Unauthorized
from common.files import require_private

log = logging.getLogger(__name__)

# Routes (as registered) anyone who reaches the port may read: no prompt, key or path.
OPEN_ROUTES = frozenset({"/", "/health", "/metrics", "/openapi.json", "/status", "/static/{name}"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = ("Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, "
                "OpenAI-Organization, OpenAI-Project, x-stainless-arch, x-stainless-lang, "
                "x-stainless-os, x-stainless-package-version, x-stainless-runtime, "
                "x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout")
CORS_MAX_AGE_S = 600
AUTHORIZED = web.RequestKey("authorized", bool)
# May this caller see what could name a file (a worker's log tail, a model's path)?
DETAILED = web.RequestKey("detailed", bool)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(key: str) -> bytes:
    # Hash first, so the comparison takes the same time whatever the length of the guess.
    return hashlib.sha256(key.encode()).digest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name part of a Host header: lower case, without the port; IPv6 keeps its brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[:end + 1] if end > 0 else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    if host.count(":") > 1:  # a bare IPv6 address, as some clients send it
        return f"[{host}]"
    return host.rstrip(".")


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The rules, built once from the config. Pure: header values in, answers out."""

    key_digests: tuple[bytes, ...] = ()
    allowed_hosts: frozenset[str] | None = None   # None: no Host check
    cors_origins: frozenset[str] = frozenset()
    bound_to_loopback: bool = True

    @classmethod
    def build(cls, keys: Iterable[str], bind_host: str, extra_hosts: Iterable[str],
              cors_origins: Iterable[str]) -> AccessPolicy:
        extra = {host_name(h) for h in extra_hosts}
        hosts = None
        if is_loopback(bind_host) or extra:
            hosts = frozenset(LOOPBACK_NAMES | extra)
        return cls(key_digests=tuple(_digest(k) for k in keys), allowed_hosts=hosts,
                   cors_origins=frozenset(o.rstrip("/") for o in cors_origins),
                   bound_to_loopback=is_loopback(bind_host))

    @property
    def has_key(self) -> bool:
        return bool(self.key_digests)

    def may_see_details(self, authorized: bool) -> bool:
        """A caller with the key; without a key set, only while the server answers this Mac
        alone (bound off loopback with no key, the network would read a worker's log tail)."""
        return authorized if self.has_key else self.bound_to_loopback

    def is_authorized(self, authorization: str | None, x_api_key: str | None) -> bool:
        """True when no key is set, or the request carries one of the keys."""
        if not self.key_digests:
            return True
        offered = x_api_key
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                offered = token.strip()
        if not offered:
            return False
        guess = _digest(offered)
        # Compare with every key, so the time does not say which (if any) matched.
        matches = [hmac.compare_digest(guess, d) for d in self.key_digests]
        return any(matches)

    def is_host_allowed(self, host: str | None) -> bool:
        if self.allowed_hosts is None or host is None:
            return True
        return host_name(host) in self.allowed_hosts

    def is_origin_allowed(self, origin: str, host: str | None) -> bool:
        """A listed origin, or the server's own (same-origin requests carry Origin too)."""
        origin = origin.strip().rstrip("/")
        if origin in self.cors_origins:
            return True
        parts = urlsplit(origin)
        return bool(host) and parts.scheme in ("http", "https") and \
            parts.netloc.lower() == (host or "").strip().lower()

    def cors_headers(self, origin: str | None) -> dict[str, str]:
        if origin is None or origin.strip().rstrip("/") not in self.cors_origins:
            return {}
        return {"Access-Control-Allow-Origin": origin.strip().rstrip("/"), "Vary": "Origin"}


def load_api_keys(cfg: RouterConfig) -> list[str]:
    """The keys from --api-key (or MLX_ROUTER_API_KEY) and --api-key-file."""
    keys = [cfg.api_key.strip()] if cfg.api_key else []
    if cfg.api_key_file:
        keys += read_key_file(Path(cfg.api_key_file).expanduser())
    return keys


def read_key_file(path: Path) -> list[str]:
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc.__class__.__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--api-key-file {path}: not a regular file")
    require_private(path, "--api-key-file", st=st)
    keys = [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key")
    return keys


def exposure_warnings(cfg: RouterConfig, policy: AccessPolicy) -> list[str]:
    """What an operator should know about who can reach this router (also in /health)."""
    if is_loopback(cfg.host) or policy.has_key:
        return []
    return [f"listening on {cfg.host} without an API key: anyone who can reach port "
            f"{cfg.port} can use this server (set MLX_ROUTER_API_KEY or --api-key-file)"]


def is_open(request: web.Request) -> bool:
    """Judged by the route that will run, not the path's spelling (encoded slashes, dots)."""
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical in OPEN_ROUTES


def make_access_middleware(
    policy: AccessPolicy, on_refused: Callable[[web.Request, HeadroomError], None] = lambda r, e: None,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware; ``on_refused`` hears of each refusal (counted and shown in /status)."""

    @web.middleware
    async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            preflight = check(request)
        except (HostNotAllowed, OriginNotAllowed, Unauthorized) as exc:
            on_refused(request, exc)
            raise
        return preflight if preflight is not None else await handler(request)

    def check(request: web.Request) -> web.Response | None:
        """Raise if the request may not go on; a CORS preflight is answered here."""
        host = request.headers.get("Host")
        if not policy.is_host_allowed(host):
            raise HostNotAllowed("this server does not answer to that Host name "
                                 "(add it with --allowed-host)")
        origin = request.headers.get("Origin")
        if origin is not None and not policy.is_origin_allowed(origin, host):
            raise OriginNotAllowed("cross-origin requests from this origin are not allowed "
                                   "(add it with --cors-origin)")
        if request.method == "OPTIONS" and origin is not None \
                and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": CORS_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S)})
        authorized = policy.is_authorized(request.headers.get("Authorization"),
                                          request.headers.get("x-api-key"))
        request[AUTHORIZED] = authorized
        request[DETAILED] = policy.may_see_details(authorized)
        if not authorized and not is_open(request):
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer KEY' "
                               "or 'x-api-key: KEY')")
        return None

    return access_middleware


def make_cors_signal(policy: AccessPolicy) -> Callable[[web.Request, web.StreamResponse],
                                                         Awaitable[None]]:
    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        for name, value in policy.cors_headers(request.headers.get("Origin")).items():
            response.headers[name] = value

    return add_cors_headers


class BadHttpLogFilter(logging.Filter):
    """aiohttp logs a malformed request (an oversized header, bytes that are not HTTP) as an
    ERROR with a traceback; for a server on a network that is noise an attacker controls.
    Keep one line at INFO instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "refused a malformed HTTP request: %s", (
                f"{exc.code} {str(exc.message).splitlines()[0][:120]}",)
            record.exc_info, record.exc_text = None, None
        return True
