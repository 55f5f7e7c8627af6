"""The OpenAPI 3 document of `vigil ui`'s API (runners/cli/api.py), written by hand and
served at /api/v1/openapi.json; tests/integration/test_http_api.py runs schemathesis on it
against a real server, so it stays true to what the routes answer."""

from __future__ import annotations

import signal
from typing import Any

NAME_PATTERN = "^[a-z0-9][a-z0-9-]{0,62}$"
INT = {"type": "integer"}
INT_OR_NULL = {"type": ["integer", "null"]}
TEXT_OR_NULL = {"type": ["string", "null"]}
MODE = {"type": "string", "enum": ["overlap", "hold"]}
SIGNALS = sorted(s.name.removeprefix("SIG") for s in signal.Signals)  # HUP, USR1, ...


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json({"$ref": "#/components/schemas/Error"}, description)


ERRORS = {"401": _error("No bearer token, or not the server's: nothing was done"),
          "404": _error("No host of that name"),
          "400": _error("A body or field that is not what the action takes"),
          "409": _error("Refused now (e.g. a wake while one is unproven, nothing to signal)"),
          "415": _error("A body that is not application/json"),
          "413": _error("A body over 16 KiB")}
UNSTAGED = {"422": _error("The build named cannot be staged (no such file, not a regular "
                          "file, not executable)")}
HOST = {"name": "name", "in": "path", "required": True, "example": "web",
        "schema": {"type": "string", "pattern": NAME_PATTERN}}
QUEUED = _json({"$ref": "#/components/schemas/Queued"},
               "The intent row written (the agent acts on it): its kind and id")
DONE = _json({"$ref": "#/components/schemas/Queued"},
             "Nothing to write (e.g. already awake), or a job's build set: id is null")


def _post(summary: str, body: dict[str, Any] | None, ok: dict[str, Any],
          required: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "parameters": [HOST],
                          "security": [{"bearer": []}], "responses": {**ok, **ERRORS}}
    if body is not None:
        op["requestBody"] = {"required": required,
                             "content": {"application/json": {"schema": body}}}
    return {"post": op}


def _body(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _get(summary: str, schema: dict[str, Any], params: list[dict[str, Any]] | None = None,
         errors: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": _json(schema, summary), **(errors or {})}}
    if params:
        op["parameters"] = params
    return {"get": op}


def _query(name: str, description: str, minimum: int, maximum: int | None = None
           ) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema}


SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {
        "error": {"type": "string", "description": "one line: the cause and the fix"}}},
    "Queued": {"type": "object", "required": ["kind", "id"], "properties": {
        "kind": {"type": "string", "enum": ["wake", "stop", "attempt", "converge"]},
        "id": INT_OR_NULL, "held_down": TEXT_OR_NULL, "build": {"type": "string"},
        "state": {"type": "string", "description": "the row's state; a job's wake: enabled"}}},
    "Host": {"type": "object", "description": "`vigil status --json`'s row of one host",
             "required": ["host", "kind", "state", "desired", "generation", "pid"],
             "properties": {"host": {"type": "string"}, "kind": {"type": "string"},
                            "state": {"type": "string"}, "desired": {"type": "string"},
                            "generation": INT_OR_NULL, "pid": INT_OR_NULL,
                            "build_digest": TEXT_OR_NULL,
                            # a job's (docs/guides/jobs.md, heard and seen)
                            "next_run": TEXT_OR_NULL, "last_success": TEXT_OR_NULL,
                            "last_run": {"type": ["object", "null"], "description":
                                         "a job's newest run done, failed or interrupted"},
                            "run": {"type": ["object", "null"],
                                    "description": "a job's run in flight"}}},
    "Obligation": {"type": "object", "description": "a row of the pending_obligations view",
                   "required": ["kind", "host", "since", "attempts"], "properties": {
                       "kind": {"type": "string"}, "host": TEXT_OR_NULL,
                       "generation": INT_OR_NULL, "since": TEXT_OR_NULL, "attempts": INT,
                       "next_attempt_at": TEXT_OR_NULL, "last_error": TEXT_OR_NULL}},
    "Event": {"type": "object", "required": ["id", "at", "host", "generation", "kind", "detail"],
              "properties": {"id": INT, "at": {"type": "string"}, "host": TEXT_OR_NULL,
                             "generation": INT_OR_NULL, "kind": {"type": "string"},
                             "detail": {"type": "object", "description": "cut to ids, builds, "
                                        "modes, waves and reasons, as on the page"}}},
    "Run": {"type": "object", "description": "one scheduled instant of a job and its run",
            "required": ["id", "host", "scheduled_at", "state", "exit_status", "generation"],
            "properties": {"id": INT, "host": {"type": "string"},
                           "scheduled_at": {"type": "string"}, "cause": TEXT_OR_NULL,
                           "state": {"type": "string"}, "started_at": TEXT_OR_NULL,
                           "ended_at": TEXT_OR_NULL, "exit_status": INT_OR_NULL,
                           "duration": {"type": ["number", "null"]},
                           "generation": INT_OR_NULL, "reason": TEXT_OR_NULL}},
    "Signalled": {"type": "object", "required": ["kind", "signal", "processes"], "properties": {
        "kind": {"type": "string", "enum": ["signal"]}, "signal": {"type": "string"},
        "processes": {"type": "array", "items": {"type": "object", "required": [
            "generation", "slot", "pid", "sent"], "properties": {
            "generation": INT, "slot": INT, "pid": INT_OR_NULL, "sent": {"type": "boolean"}}}}}},
}


def _paths() -> dict[str, Any]:
    ref = "#/components/schemas/"
    return {
        "/api/v1/hosts": _get("Every host's status row", {"type": "object", "required": [
            "hosts"], "properties": {"hosts": {"type": "array", "items": {"$ref": ref + "Host"}}}}),
        "/api/v1/hosts/{name}": _get("One host's status row", {"$ref": ref + "Host"},
                                     [HOST], {"404": _error("No host of that name")}),
        "/api/v1/hosts/{name}/runs": _get(
            "A job's runs, newest scheduled instant first (`vigil runs NAME`)", {
                "type": "object", "required": ["runs"], "properties": {"runs": {
                    "type": "array", "items": {"$ref": ref + "Run"}}}},
            [HOST, _query("limit", "at most this many (default 100)", 1, 1000)],
            {"400": _error("limit not a whole number in range"),
             "404": _error("No host of that name")}),
        "/api/v1/obligations": _get("Every open obligation (pending_obligations)", {
            "type": "object", "required": ["obligations"], "properties": {"obligations": {
                "type": "array", "items": {"$ref": ref + "Obligation"}}}}),
        "/api/v1/events": _get("Events after an id, oldest first", {
            "type": "object", "required": ["events"], "properties": {"events": {
                "type": "array", "items": {"$ref": ref + "Event"}}}},
            [_query("after", "answer events whose id is above this (0: from the first)", 0,
                    2**63 - 1),
             _query("limit", "at most this many (default 100)", 1, 1000)],
            {"400": _error("after or limit not a whole number in range")}),
        "/api/v1/hosts/{name}/wake": _post("Wake the host (`vigil wake`)", _body({}),
                                           {"202": QUEUED, "200": DONE}),
        "/api/v1/hosts/{name}/stop": _post(
            "Stop the host (`vigil stop`; force: even while hosts that start after it are up)",
            _body({"force": {"type": "boolean"}}), {"202": QUEUED}),
        "/api/v1/hosts/{name}/restart": _post(
            "Restart the host on its build (`vigil restart`; woken if not running)",
            _body({"mode": MODE}), {"202": QUEUED, "200": DONE}),
        "/api/v1/hosts/{name}/deploy": _post(
            "Deploy a build (`vigil deploy NAME BUILD`): staged, then an attempt queued",
            _body({"build": {"type": "string", "pattern": "^/[^\\u0000]*$",
                             "description": "absolute path of an executable file on the "
                             "server's box", "example": "/srv/builds/app-2"},
                   "mode": MODE, "canary": {"type": "boolean"}}, ("build",)), {"202": QUEUED, "200": DONE, **UNSTAGED}, required=True),
        "/api/v1/hosts/{name}/signal": _post(
            "Send a signal to each current generation's leader (`vigil signal`), at once",
            _body({"signal": {"type": "string", "enum": SIGNALS, "example": "HUP"}}, ("signal",)),
            {"200": _json({"$ref": ref + "Signalled"}, "Which leaders were sent it")},
            required=True),
    }


DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "vigil", "version": "1",
             "description": "The HTTP API of `vigil ui`: reads with the page's rules; every "
                            "POST needs the bearer token (also on loopback) and writes the "
                            "intent row the CLI's verb writes, answering its id (202) without "
                            "waiting on the agent. See docs/reference/http-api.md."},
    "paths": _paths(),
    "components": {"schemas": SCHEMAS, "securitySchemes": {
        "bearer": {"type": "http", "scheme": "bearer"}}},
}
