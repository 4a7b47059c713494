"""An independent MCP server over streamable HTTP, for gateway-svc's end-to-end tests.

Built on the Python SDK's low-level `Server` (mcp 2.x) rather than `MCPServer`, so that the
tool schemas are exactly the JSON Schema written here (not derived from type hints) and so that
every `tools/call` reaches `on_call_tool` unvalidated: the calls log then records what arrived on
the wire, which is what a test needs to prove that the gateway never forwarded bad arguments.

    python mcp_demo_server.py --port 0 --calls-log PATH [--require-token TOKEN]
                              [--list-changed-on request|standalone|both] [--exit-on-stdin-eof]

Listens on 127.0.0.1 only, serves `/mcp`, and prints exactly one line `LISTENING <port>` on
stdout once uvicorn accepts connections (everything else goes to stderr).

Sessions are stateful (`Mcp-Session-Id`) for clients that use the initialize handshake
(protocol versions up to 2025-11-25). A request whose `MCP-Protocol-Version` header names
2026-07-28 is served by the SDK's per-request (sessionless) path instead; there the tools list
change is delivered through `subscriptions/listen`.

Calls log: one JSON line per call that reaches the server, `{"tool": name, "args": {...}}`,
written before anything else happens in the call; `slow` then writes
`{"event": "slow-started", "seconds": N}` right before it sleeps.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import sys
import threading
from typing import Any

import anyio
import uvicorn
from mcp import types
from mcp.server import NotificationOptions, Server, ServerRequestContext
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ToolsListChanged
from mcp.types.version import MODERN_PROTOCOL_VERSIONS

BIG_REPORT_CHARS = 40_000

READ_ONLY = types.ToolAnnotations(read_only_hint=True)


def _big_report() -> str:
    # 1,000 lines of exactly 40 characters ("row 00000 " + 29 dots + "\n"): 40,000 ASCII
    # characters, with line numbers so a truncation point is visible in a failure message.
    text = "".join(f"row {i:05d} " + "." * 29 + "\n" for i in range(BIG_REPORT_CHARS // 40))
    assert len(text) == BIG_REPORT_CHARS
    return text


class CallsLog:
    """Append-only JSON-lines file; each line is flushed at once because a test reads it while
    the server runs (and may kill it with SIGKILL right after)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        # Create (or keep) the file up front so that a reader never sees "no such file".
        open(path, "a", encoding="utf-8").close()

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n"
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()


class DemoServer(Server[Any]):
    """The low-level server, advertising `tools.listChanged: true` on the handshake path.

    Without the override the SDK advertises `listChanged: false` (it only sets the flag from
    `NotificationOptions`, which the streamable-HTTP session manager never passes)."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )


def _text(text: str, *, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=is_error)


def build_server(calls: CallsLog, list_changed_on: str) -> DemoServer:
    # name -> Tool; `add_tool` adds to it at run time (server-wide, every session sees it).
    tools: dict[str, types.Tool] = {}
    dynamic: set[str] = set()
    bus = InMemorySubscriptionBus()

    def define(name: str, description: str, schema: dict[str, Any], annotations: types.ToolAnnotations | None):
        tools[name] = types.Tool(name=name, description=description, input_schema=schema, annotations=annotations)

    define(
        "lookup",
        "Look something up (read-only).",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        READ_ONLY,
    )
    define(
        "big_report",
        f"Return a {BIG_REPORT_CHARS}-character report (read-only).",
        {"type": "object", "properties": {}, "additionalProperties": False},
        READ_ONLY,
    )
    define(
        "slow",
        "Sleep for `seconds`, then return 'done' (read-only).",
        {
            "type": "object",
            "properties": {"seconds": {"type": "number", "minimum": 0}},
            "required": ["seconds"],
            "additionalProperties": False,
        },
        READ_ONLY,
    )
    define(
        "write_note",
        "Write a note (no annotations: a client must treat it as possibly destructive).",
        {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
        None,
    )
    define(
        "add_tool",
        "Register a new read-only tool called `name` and announce the change.",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1}},
            "required": ["name"],
            "additionalProperties": False,
        },
        None,
    )

    async def on_list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(tools.values()))

    async def announce_list_changed(ctx: ServerRequestContext[Any]) -> None:
        # Handshake-era clients get the notification on the session: on the tools/call's own
        # response stream ("request": ordered before the result, so deterministic), and/or on the
        # standalone GET stream ("standalone": what most servers do; dropped by the SDK if the
        # client has not opened that stream yet). 2026-07-28 clients get it via
        # subscriptions/listen, which is fed by the bus.
        # (At 2026-07-28 an unsolicited list_changed on a request stream is not allowed.)
        handshake_era = ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS
        if handshake_era and list_changed_on in ("request", "both"):
            await ctx.session.send_notification(types.ToolListChangedNotification(), related_request_id=ctx.request_id)
        if handshake_era and list_changed_on in ("standalone", "both"):
            await ctx.session.send_tool_list_changed()
        await bus.publish(ToolsListChanged())

    async def on_call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        name = params.name
        args = params.arguments if params.arguments is not None else {}
        # First thing: the record of what reached the server, before any checking.
        calls.append({"tool": name, "args": args})

        if name not in tools:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {name}")
        if name in dynamic:
            return _text(f"hello from {name}")
        if name == "lookup":
            query = args.get("query")
            if not isinstance(query, str):
                return _text("lookup: `query` must be a string", is_error=True)
            return _text(f"found: {query}")
        if name == "big_report":
            return _text(_big_report())
        if name == "slow":
            seconds = args.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                return _text("slow: `seconds` must be a non-negative number", is_error=True)
            calls.append({"event": "slow-started", "seconds": seconds})
            await anyio.sleep(seconds)
            return _text("done")
        if name == "write_note":
            text = args.get("text")
            if not isinstance(text, str):
                return _text("write_note: `text` must be a string", is_error=True)
            return _text(f"noted: {text}")
        if name == "add_tool":
            new = args.get("name")
            if not isinstance(new, str) or not new:
                return _text("add_tool: `name` must be a non-empty string", is_error=True)
            if new in tools:
                return _text(f"add_tool: a tool called {new!r} already exists", is_error=True)
            define(new, "Added at run time; says hello (read-only).", {"type": "object", "properties": {}}, READ_ONLY)
            dynamic.add(new)
            await announce_list_changed(ctx)
            return _text(f"added {new}")
        raise AssertionError(f"tool {name} is listed but has no implementation")

    return DemoServer(
        "steward-mcp-demo",
        version="1.0.0",
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
        on_subscriptions_listen=ListenHandler(bus),
    )


class RequireBearer:
    """ASGI middleware: every HTTP request (POST, GET, DELETE alike) must carry
    `Authorization: Bearer <token>`, else 401 before the MCP layer sees it."""

    def __init__(self, app: Any, token: str) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self._expected):
                body = b'{"error":"missing or wrong bearer token"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="mcp-demo"'),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self._app(scope, receive, send)


class AnnouncingServer(uvicorn.Server):
    """Prints `LISTENING <port>` once the socket is accepting, i.e. after the app's lifespan
    (the MCP session manager) has started, so the first request cannot race the startup."""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        sys.stdout.write(f"LISTENING {port}\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 picks a free one")
    parser.add_argument("--calls-log", required=True, help="JSON-lines file that records every tool call")
    parser.add_argument("--require-token", default=None, help="refuse (401) requests without this bearer token")
    parser.add_argument(
        "--list-changed-on",
        choices=("request", "standalone", "both"),
        default="request",
        help="where add_tool sends notifications/tools/list_changed on a handshake-era session "
        "(default: the tools/call response stream, ordered before the result)",
    )
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="exit when stdin closes: a test holds the pipe, so the server dies with the test process",
    )
    args = parser.parse_args()

    if args.exit_on_stdin_eof:

        def watch_stdin() -> None:
            # Blocks until the parent closes its end of the pipe (or dies), then ends the process
            # at once, open sessions and all.
            sys.stdin.buffer.read()
            os._exit(0)

        threading.Thread(target=watch_stdin, name="stdin-watchdog", daemon=True).start()

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="mcp-demo %(levelname)s %(name)s: %(message)s")

    server = build_server(CallsLog(args.calls_log), args.list_changed_on)
    # host="127.0.0.1" also turns on the SDK's DNS-rebinding protection, which accepts
    # Host: 127.0.0.1:*, localhost:* and [::1]:* only.
    app: Any = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    if args.require_token is not None:
        app = RequireBearer(app, args.require_token)

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,  # uvicorn's access log goes to stdout, which is reserved for LISTENING
        lifespan="on",
        # A test kills the server when it is done; no need to wait for open SSE streams.
        timeout_graceful_shutdown=1,
    )
    AnnouncingServer(config).run()


if __name__ == "__main__":
    main()
