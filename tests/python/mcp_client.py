"""An independent MCP client over streamable HTTP (the Python SDK's), for end-to-end tests.

    python mcp_client.py --url http://127.0.0.1:PORT/mcp [--header 'Name: value']...
                         [--call TOOL [--args JSON]] [--list-after]
                         [--mode legacy|auto|2026-07-28] [--timeout SECONDS]

Initializes, lists the tools, optionally calls one, and prints exactly one JSON line on stdout:

    {"ok": true, "protocol_version": "...", "tools": [names], "tool_schemas": {name: inputSchema},
     "tool_annotations": {name: annotations or null},
     "call": {"is_error": bool, "text": "<text contents joined with newlines>"},
     "tools_after": [names],   # with --list-after: a second tools/list after the call
     "notifications": [methods]}   # notifications the server sent during the session

On any failure (HTTP error status, connection refused, JSON-RPC error, timeout) it prints
`{"ok": false, "stage": "connect|list|call|list_after", "error": "...", "http_status": N?,
"code": N?}` and exits with 2. `--mode legacy` (the default) is the initialize handshake with
an `Mcp-Session-Id` session; `auto` probes `server/discover` first; `2026-07-28` skips the
handshake and uses the per-request protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx2
from mcp import Client, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

EXIT_FAILURE = 2


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def leaves(exc: BaseException) -> list[BaseException]:
    """The non-group exceptions inside `exc`: anyio task groups wrap a transport failure
    (an HTTP 401, a refused connection) in one or more ExceptionGroups."""
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(leaves(inner))
        return out
    return [exc]


def describe(exc: BaseException, http_errors: list[tuple[str, int]]) -> dict[str, Any]:
    """A readable message plus the HTTP status / JSON-RPC code when one is known."""
    found = leaves(exc)
    # Prefer the most informative leaf: an HTTP status error, then an MCP error, then any.
    found.sort(key=lambda e: 0 if isinstance(e, httpx2.HTTPStatusError) else 1 if isinstance(e, MCPError) else 2)
    info: dict[str, Any] = {}
    parts: list[str] = []
    for e in found:
        seen: set[int] = set()
        cur: BaseException | None = e
        # Walk the cause/context chain too: the SDK re-raises transport errors as MCPError.
        while cur is not None and id(cur) not in seen:
            seen.add(id(cur))
            if isinstance(cur, httpx2.HTTPStatusError) and "http_status" not in info:
                info["http_status"] = cur.response.status_code
            if isinstance(cur, MCPError) and "code" not in info:
                info["code"] = cur.code
            cur = cur.__cause__ or cur.__context__
        text = f"{type(e).__name__}: {e}".strip()
        if text not in parts:
            parts.append(text)
    message = "; ".join(parts) or type(exc).__name__
    if "http_status" not in info and http_errors:
        info["http_status"] = http_errors[0][1]
    if http_errors:
        message += " (HTTP errors: " + ", ".join(f"{m} {s}" for m, s in http_errors) + ")"
    if "http_status" in info:
        message = f"HTTP {info['http_status']}: {message}"
    info["error"] = message
    return info


def notification_method(message: Any) -> str | None:
    if isinstance(message, Exception):
        return None
    method = getattr(message, "method", None)
    if method is None:
        method = getattr(getattr(message, "root", None), "method", None)
    return method if isinstance(method, str) else None


async def run(args: argparse.Namespace, call_args: dict[str, Any] | None) -> dict[str, Any]:
    headers: dict[str, str] = {}
    for raw in args.header:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f"--header must look like 'Name: value', got {raw!r}")
        headers[name.strip()] = value.strip()

    notifications: list[str] = []

    async def on_message(message: Any) -> None:
        method = notification_method(message)
        if method is not None:
            notifications.append(method)

    # The SDK turns a non-2xx answer into a JSON-RPC error (-32603 "Server returned an error
    # response") and drops the status, so the HTTP layer records it here for the failure line.
    http_errors: list[tuple[str, int]] = []

    async def on_response(response: httpx2.Response) -> None:
        if response.status_code >= 400:
            http_errors.append((response.request.method, response.status_code))

    out: dict[str, Any] = {"ok": True}
    stage = "connect"
    try:
        async with AsyncExitStack() as stack:
            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=headers,
                    timeout=httpx2.Timeout(args.timeout, read=args.timeout),
                    # Never route loopback through a proxy from the environment.
                    trust_env=False,
                    event_hooks={"response": [on_response]},
                )
            )
            client = await stack.enter_async_context(
                Client(
                    streamable_http_client(args.url, http_client=http),
                    mode=args.mode,
                    message_handler=on_message,
                    read_timeout_seconds=args.timeout,
                    cache=None,  # every list goes to the server (a list after add_tool must be fresh)
                )
            )
            out["protocol_version"] = client.protocol_version

            stage = "list"
            listing = await list_all(client)
            out["tools"] = [t.name for t in listing]
            out["tool_schemas"] = {t.name: t.input_schema for t in listing}
            out["tool_annotations"] = {
                t.name: (t.annotations.model_dump(by_alias=True, exclude_none=True) if t.annotations else None)
                for t in listing
            }

            if args.call is not None:
                stage = "call"
                result = await client.call_tool(args.call, call_args)
                texts = [c.text for c in result.content if isinstance(c, types.TextContent)]
                out["call"] = {"is_error": bool(result.is_error), "text": "\n".join(texts)}

            if args.list_after:
                stage = "list_after"
                out["tools_after"] = [t.name for t in await list_all(client)]
            out["notifications"] = list(notifications)
    except Exception as exc:  # noqa: BLE001 - everything becomes the one failure line
        # (Cancellation by the timeout is a BaseException and goes on up to `bounded`.)
        return {"ok": False, "stage": stage, **describe(exc, http_errors)}
    return out


async def list_all(client: Client) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a server whose cursor never ends cannot hang the client
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    parser.add_argument("--call", default=None, help="tool to call after listing")
    parser.add_argument("--args", default="{}", help="the call's arguments, a JSON object")
    parser.add_argument("--list-after", action="store_true", help="list the tools again after the call")
    parser.add_argument("--mode", default="legacy", help="legacy (default), auto, or 2026-07-28")
    parser.add_argument("--timeout", type=float, default=20.0, help="bound on the whole run, seconds")
    args = parser.parse_args()

    call_args: dict[str, Any] | None = None
    if args.call is not None:
        try:
            call_args = json.loads(args.args)
        except json.JSONDecodeError as e:
            emit({"ok": False, "stage": "args", "error": f"--args is not JSON: {e}"})
            sys.exit(EXIT_FAILURE)
        if not isinstance(call_args, dict):
            emit({"ok": False, "stage": "args", "error": "--args must be a JSON object"})
            sys.exit(EXIT_FAILURE)

    # Last resort if cancellation itself hangs (e.g. a cleanup request that never returns):
    # the process still ends, with a failure line, a little after the timeout.
    def hard_stop(_signum: int, _frame: Any) -> None:
        emit({"ok": False, "stage": "timeout", "error": f"no result within {args.timeout + 5:.0f}s (hard stop)"})
        os._exit(EXIT_FAILURE)

    signal.signal(signal.SIGALRM, hard_stop)
    signal.alarm(int(args.timeout) + 5)

    async def bounded() -> dict[str, Any]:
        with anyio.move_on_after(args.timeout) as scope:
            return await run(args, call_args)
        assert scope.cancelled_caught
        return {"ok": False, "stage": "timeout", "error": f"no result within {args.timeout:.0f}s"}

    record = anyio.run(bounded)
    signal.alarm(0)
    emit(record)
    sys.exit(0 if record.get("ok") else EXIT_FAILURE)


if __name__ == "__main__":
    main()
