"""The API's front door: a pure ASGI middleware that decides on a request before its body is
read.

For every request it finds the route, then, before a single body byte is received:

1. **Authentication** (every route but the public ones): the bearer token's signature,
   expiry and revocation (a database lookup, in a thread), then the route's role (the role
   check its dependencies declare). A refusal is 401/403 with the reason.
2. **Body size**, per route: a ``Content-Length`` over the route's limit is refused with 413;
   a body without one (chunked) is counted as it streams and refused the moment it passes the
   limit. JSON routes get ``KILN_MAX_JSON_BYTES``; an upload route names its own limit with
   ``openapi_extra={BODY_LIMIT: "<settings field>"}`` (it shows in the OpenAPI document).
   The refusal's code is ``payload_too_large``, or the one the route names with
   ``BODY_ERROR`` (the model upload: ``model_too_large``).

The principal goes into the request's state, so the route's dependencies do not decode the
token again; they still check the role (the route keeps its own guard).

Browsers cannot send a bearer header on a navigation, so under the dashboard's prefix
(``BrowserPaths``) a request without one is authenticated by the session cookie the login page
set, and a refusal is the dashboard's own answer (a redirect to its login page, a readable
403) rather than a JSON body. Everywhere else the cookie counts for nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.errors import ErrorBody, ErrorCode, KilnError
from services.api.auth import (
    Principal,
    Role,
    check_agent,
    decode_token,
    require_role,
    revoked_error,
)
from services.api.errors import DATABASE_ERRORS, RETRY_AFTER, database_unavailable
from services.api.revocations import RevocationList
from services.config import KilnSettings

logger = logging.getLogger(__name__)

#: ``openapi_extra`` key of an upload route: the settings field holding its body limit.
BODY_LIMIT = "x-kiln-body-limit"
#: ``openapi_extra`` key of a route whose body over its limit is refused with another code
#: than ``payload_too_large`` (an ``ErrorCode`` value).
BODY_ERROR = "x-kiln-body-error"
#: ``openapi_extra`` key naming the path parameter of the agent a route acts for: an agent
#: token speaks only for the agent it names, checked before the body is read.
AGENT_PARAM = "x-kiln-agent-param"
#: The attribute on a dependency callable that marks it as a role check: the roles it admits
#: besides admin (``None``: any authenticated role).
ROLES_ATTR = "__kiln_roles__"
#: Room for multipart framing on top of an upload's payload limit.
MULTIPART_SLACK = 64 * 1024
#: The state key the principal is stored under.
PRINCIPAL = "kiln_principal"


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes its limit. An ``HTTPException``, so
    that FastAPI's body parsing passes it on instead of answering 400."""

    def __init__(self, seen: int, policy: _Policy) -> None:
        super().__init__(413, policy.too_large(seen))
        #: The route's code for the refusal (read by the API's handler of HTTP errors, which
        #: answers when the route's body parsing passes this on).
        self.code = policy.too_large_code


@dataclass(frozen=True)
class _Policy:
    #: ``None``: public (no token needed); else the roles admitted besides admin, where an
    #: empty tuple means admin only and ``ANY`` any authenticated role.
    roles: tuple[Role, ...] | None
    #: The setting that bounds the body, and its value.
    limit_name: str
    setting: int
    #: Bytes allowed on top of it (an upload's multipart framing).
    slack: int = 0
    #: The refusal's code.
    too_large_code: ErrorCode = ErrorCode.PAYLOAD_TOO_LARGE
    #: The path parameter naming the agent the route acts for (``AGENT_PARAM`` in its
    #: ``openapi_extra``): an agent token for another agent is refused before the body.
    agent_param: str | None = None

    @property
    def limit(self) -> int:
        return self.setting + self.slack

    def too_large(self, size: int) -> str:
        framing = f" (plus {self.slack} bytes of multipart framing)" if self.slack else ""
        return (f"request body of at least {size} bytes is over this route's limit of "
                f"{self.setting} bytes{framing}; the limit is {self.limit_name}")


ANY: tuple[Role, ...] = tuple(Role)


@dataclass(frozen=True)
class BrowserPaths:
    """The dashboard's paths: ``prefix`` (and everything under it) accepts the session cookie
    ``cookie`` in place of a bearer header; ``refuse(scope, error)`` answers a refused
    request there."""

    prefix: str
    cookie: str
    refuse: Callable[[Scope, KilnError], Response]

    def covers(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")

    def authorization(self, headers: dict[bytes, bytes]) -> str | None:
        raw = headers.get(b"cookie")
        token = cookie_parser(raw.decode("latin-1")).get(self.cookie) if raw else None
        return f"Bearer {token}" if token else None


def route_roles(dependant: Dependant) -> tuple[Role, ...] | None:
    """The roles a route admits, from the role checks among its dependencies (the narrowest
    wins); ``None`` when it declares none (a public route)."""
    found: list[tuple[Role, ...]] = []

    def walk(node: Dependant) -> None:
        for dep in node.dependencies:
            marker = getattr(dep.call, ROLES_ATTR, False)
            if marker is not False:
                found.append(ANY if marker is None else tuple(marker))
            walk(dep)

    walk(dependant)
    if not found:
        return None
    allowed = set(found[0])
    for roles in found[1:]:
        allowed &= set(roles)
    return tuple(sorted(allowed))


class FrontDoor:
    """See the module docstring. ``routes`` is the app's route list (read at request time),
    ``public`` the paths that need no token, ``revocations`` the revoked token ids,
    ``browser`` the dashboard's paths (``None``: no dashboard)."""

    def __init__(self, app: ASGIApp, *, settings: KilnSettings, routes: list[BaseRoute],
                 public: Iterable[str], revocations: RevocationList,
                 browser: BrowserPaths | None = None) -> None:
        self.app = app
        self.browser = browser
        self.settings = settings
        self.routes = routes
        self.public = frozenset(public)
        self.revocations = revocations
        self._policies: list[tuple[RouteContext, _Policy | None]] | None = None
        #: The routes by the static segments their path template starts with (before its
        #: first parameter), in the order they are matched: a request is matched against
        #: the few whose segments its path starts with, not all of them. Keyed by templates
        #: only: nothing a client sends is kept (a cache by request path held every
        #: unauthenticated path sent, up to gigabytes).
        self._index: dict[tuple[str, ...], list[tuple[int, RouteContext, _Policy | None]]] \
            | None = None
        self._depth = 0

    # ------------------------------------------------------------ policy per route
    def _json_policy(self, roles: tuple[Role, ...] | None) -> _Policy:
        return _Policy(roles=roles, limit_name="KILN_MAX_JSON_BYTES",
                       setting=self.settings.max_json_bytes)

    def _route_policies(self) -> list[tuple[RouteContext, _Policy | None]]:
        """Every route (through included routers) with its policy (``None``: not an
        ``APIRoute``, e.g. the documentation), computed once."""
        if self._policies is None:
            policies: list[tuple[RouteContext, _Policy | None]] = []
            for context in iter_route_contexts(self.routes):
                route = context.original_route
                if isinstance(route, APIRoute) and route.path not in self.public:
                    policies.append((context, self._policy_of(route)))
                else:
                    policies.append((context, None))
            self._policies = policies
        return self._policies

    def _policy_of(self, route: APIRoute) -> _Policy:
        roles = route_roles(route.dependant)
        if roles is None:
            # Deny by default: a route is public only when its path is listed as such.
            logger.warning("route %s %s declares no role check; admitting admins only",
                           sorted(route.methods), route.path)
            roles = ()
        extra = route.openapi_extra or {}
        field = extra.get(BODY_LIMIT)
        if field is None:
            policy = self._json_policy(roles)
        else:
            policy = _Policy(roles=roles, limit_name=f"KILN_{field.upper()}",
                             setting=int(getattr(self.settings, field)), slack=MULTIPART_SLACK)
        if (agent_param := extra.get(AGENT_PARAM)) is not None:
            policy = dataclasses.replace(policy, agent_param=agent_param)
        if (code := extra.get(BODY_ERROR)) is not None:
            policy = dataclasses.replace(policy, too_large_code=ErrorCode(code))
        return policy

    def policy(self, scope: Scope) -> _Policy:
        return self.match(scope)[0]

    def match(self, scope: Scope) -> tuple[_Policy, dict[str, object]]:
        """The policy of the route ``scope`` reaches (a route matching the path but not the
        method counts: a 405 follows), with its path parameters; a path no route has needs a
        token (404 after)."""
        return self._match(scope.get("method"), scope.get("root_path", ""), scope["path"])

    def _route_index(self) -> dict[tuple[str, ...],
                                   list[tuple[int, RouteContext, _Policy | None]]]:
        if self._index is None:
            index: dict[tuple[str, ...], list[tuple[int, RouteContext, _Policy | None]]] = {}
            for order, (context, policy) in enumerate(self._route_policies()):
                prefix = _static_prefix(getattr(context, "path", None))
                index.setdefault(prefix, []).append((order, context, policy))
                self._depth = max(self._depth, len(prefix))
            self._index = index
        return self._index

    def remembered(self) -> int:
        """How many entries the front door keeps to match requests: one per route, however
        many distinct paths clients send."""
        return sum(len(entries) for entries in self._route_index().values())

    def _candidates(self, path: str) -> list[tuple[RouteContext, _Policy | None]]:
        """The routes that may match ``path`` (those whose template's static start it
        starts with), in matching order."""
        index = self._route_index()
        segments = path.split("/", self._depth)
        found: list[tuple[int, RouteContext, _Policy | None]] = []
        for depth in range(min(len(segments), self._depth) + 1):
            found += index.get(tuple(segments[:depth]), ())
        found.sort(key=lambda entry: entry[0])
        return [(context, policy) for _, context, policy in found]

    def _match(self, method: str | None, root_path: str,
               path: str) -> tuple[_Policy, dict[str, object]]:
        if path in self.public:
            return self._json_policy(None), {}
        scope: Scope = {"type": "http", "method": method, "root_path": root_path,
                        "path": path}
        route_path = path[len(root_path):] if root_path and path.startswith(root_path) else path
        found: tuple[_Policy | None, dict[str, object]] | None = None
        for context, policy in self._candidates(route_path):
            match, child = context.matches(scope)
            if match is Match.FULL:
                found = (policy, child.get("path_params", {}))
                break
            if match is Match.PARTIAL and found is None:
                found = (policy, child.get("path_params", {}))
        if found is None or found[0] is None:
            return self._json_policy(ANY), {}
        return found  # type: ignore[return-value]

    # ------------------------------------------------------------ the ASGI call
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (problem := control_character(scope)) is not None:
            await _reply(send, 400, ErrorBody(code=ErrorCode.INVALID_REQUEST, message=problem))
            return
        policy, path_params = self.match(scope)
        headers = dict(scope.get("headers") or [])
        if policy.roles is not None:
            raw = headers.get(b"authorization")
            authorization = raw.decode("latin-1") if raw is not None else None
            browser = self.browser if (self.browser is not None
                                       and self.browser.covers(scope["path"])) else None
            if authorization is None and browser is not None:
                authorization = browser.authorization(headers)
            try:
                principal = await self._authenticate(authorization)
                # Known before the role check, so that a refusal page can say who it refused.
                scope.setdefault("state", {})[PRINCIPAL] = principal
                require_role(principal, *policy.roles)
                if policy.agent_param is not None:  # an agent speaks only for itself
                    check_agent(principal, str(path_params.get(policy.agent_param, "")))
            except KilnError as exc:
                if browser is not None:
                    await browser.refuse(scope, exc)(scope, receive, send)
                    return
                await _reply(send, exc.http_status, exc.to_body(), _REFUSAL_HEADERS.get(exc.code))
                return

        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reply(send, 400, ErrorBody(
                    code=ErrorCode.INVALID_REQUEST,
                    message=f"Content-Length must be a byte count; got {declared!r}"))
                return
            if int(declared) > policy.limit:
                await _reply(send, 413, ErrorBody(
                    code=policy.too_large_code, message=policy.too_large(int(declared)),
                    details={"limit_bytes": policy.setting, "limit": policy.limit_name}))
                return

        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > policy.limit:
                    raise BodyTooLarge(seen, policy)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except BodyTooLarge as exc:
            if not started:
                await _reply(send, 413, ErrorBody(code=policy.too_large_code,
                                                  message=str(exc.detail),
                                                  details={"limit_bytes": policy.setting,
                                                           "limit": policy.limit_name}))

    async def _authenticate(self, authorization: str | None) -> Principal:
        # The signature and expiry first, on the loop (cheap); then the revocation list, on
        # the loop while this process's copy is fresh, else read again in a thread.
        principal = decode_token(self.settings.secret_key, authorization)
        revoked = self.revocations.known(principal.jti)
        if revoked is None:
            try:
                revoked = await run_in_threadpool(self.revocations.revoked, principal.jti)
            except DATABASE_ERRORS as exc:  # outside FastAPI's handlers: answered here
                raise database_unavailable(exc, "the revocation list") from exc
        if revoked:
            raise revoked_error(principal.jti)
        return principal


#: C0 control characters and DEL: never part of an id, a name or a query value. PostgreSQL
#: cannot store NUL in text (it failed with a 500 after the route had run), and logs must not
#: carry raw control characters.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES = re.compile(rb"[\x00-\x1f\x7f]")


def control_character(scope: Scope) -> str | None:
    """What is wrong with a request whose path or query string (percent-decoded) holds a
    control character, naming where and which (never the raw text); ``None`` when neither
    does."""
    if found := _CONTROL.search(scope["path"]):
        return (f"the request path holds the control character U+{ord(found.group()):04X} "
                f"at character {found.start()}; ids and names in a path are printable text")
    query = scope.get("query_string") or b""
    if found := _CONTROL_BYTES.search(urllib.parse.unquote_to_bytes(query.replace(b"+", b" "))):
        return (f"the query string holds the control character U+{found.group()[0]:04X} "
                f"(percent-decoded, at byte {found.start()}); query values are printable text")
    return None


def _static_prefix(template: str | None) -> tuple[str, ...]:
    """The segments of a route's path template before its first parameter (``("", "v1",
    "agents")`` for ``/v1/agents/{name}/heartbeat``); ``()`` when it has no path."""
    prefix: list[str] = []
    for segment in (template or "").split("/") if template else ():
        if "{" in segment:
            break
        prefix.append(segment)
    return tuple(prefix)


#: Headers of a refusal by the front door, by its code.
_REFUSAL_HEADERS = {ErrorCode.UNAUTHENTICATED: {"WWW-Authenticate": "Bearer"},
                    ErrorCode.DATABASE_UNAVAILABLE: RETRY_AFTER}


async def _reply(send: Send, status: int, body: ErrorBody,
                 headers: dict[str, str] | None = None) -> None:
    """Answer at once and close: the body the client may still be sending is never read."""
    payload = body.model_dump_json().encode()
    raw = [(b"content-type", b"application/json"),
           (b"content-length", str(len(payload)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
