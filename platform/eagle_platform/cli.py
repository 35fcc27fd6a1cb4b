"""``eaglectl targets ...`` and ``eaglectl platform serve``: the control plane from the command line.

Each ``targets`` command is one call to the service's HTTP API (eagle_platform.service) at
``$EAGLE_PLATFORM_URL`` (default ``http://127.0.0.1:8600``), with the token of ``$EAGLE_PLATFORM_TOKEN`` or
the service's token file. ``--json`` prints the API's JSON unchanged (the shape of ``Reconciler.status``,
documented in platform/README.md); otherwise one line per target. Errors are one line and exit code 2.

    eaglectl targets onboard NAME --source (builtin:smollm2-135m | DIR) [--preset P] [--tau-gate X] [--wait]
    eaglectl targets list [--json]
    eaglectl targets status NAME [--json] [--wait]
    eaglectl targets retrain NAME | retire NAME | rollback NAME
    eaglectl targets promote NAME VERSION
    eaglectl targets ask NAME MESSAGE [--max-tokens N]    (one chat request to the served pair)
    eaglectl platform serve [service flags]     (python -m eagle_platform.service)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from eagle_platform.pipeline import STAGE_STATES, TERMINAL
from eagle_platform.service import DEFAULT_PORT, default_state_dir, read_token

URL_ENV = "EAGLE_PLATFORM_URL"


class CliError(Exception):
    pass


class NoService(CliError):
    """Nothing answered at the service URL."""


def service_url() -> str:
    return os.environ.get(URL_ENV, f"http://127.0.0.1:{os.environ.get('EAGLE_PLATFORM_PORT', DEFAULT_PORT)}").rstrip("/")


def call(method: str, path: str, body: dict[str, Any] | None = None, *, timeout: float = 120.0) -> dict[str, Any]:
    """One API call; a 4xx/5xx or no service becomes a ``CliError`` with the service's message."""
    import httpx

    headers = {}
    token = read_token(default_state_dir())
    if method != "GET":
        if not token:
            raise CliError(f"no platform token (set $EAGLE_PLATFORM_TOKEN, or start the service once: it creates {default_state_dir() / 'token'})")
        headers["Authorization"] = f"Bearer {token}"
    url = service_url() + path
    try:
        response = httpx.request(method, url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as err:
        raise NoService(f"no platform service at {service_url()} ({type(err).__name__}); start it with `eaglectl platform serve`") from None
    try:
        data = response.json()
    except ValueError:
        data = {"error": {"message": response.text[:200]}}
    if response.status_code >= 400:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise CliError(f"{response.status_code}: {message or response.reason_phrase}")
    return data


def line(status: dict[str, Any]) -> str:
    parts = [f"{status['name']}", f"v{status['version']}", status["state"]]
    if status.get("tau") is not None:
        parts.append(f"tau {status['tau']:.2f}")
    if status.get("production_head"):
        parts.append(f"production head v{status['production_head']}")
    if status.get("reason"):
        parts.append(f"({status['reason']})")
    return "  ".join(parts)


def wait(name: str, poll_s: float = 3.0, timeout_s: float = 24 * 3600) -> dict[str, Any]:
    """Poll the status until the version is ready or failed, showing stage, job and elapsed time."""
    from tqdm import tqdm

    started = time.monotonic()
    unreachable_since = None
    stages = ("registered", *STAGE_STATES)
    with tqdm(total=len(stages), desc=name, unit="stage", file=sys.stderr, bar_format="{desc} |{bar:20}| {n}/{total}") as bar:
        while True:
            try:
                status = call("GET", f"/v1/targets/{name}")
                unreachable_since = None
            except NoService:  # a restarting service: keep waiting a while
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > 120:
                    raise
                time.sleep(poll_s)
                continue
            if status["state"] in stages:
                bar.n = stages.index(status["state"])
            progress = status.get("progress") or {}
            where = f"{name}: {status['state']}"
            if progress:
                where += f", job {progress.get('job')} {progress.get('job_status') or ''}, {progress.get('elapsed_s') or 0:.0f} s in this stage"
            bar.set_description_str(where)
            if status["state"] in TERMINAL:
                bar.n = len(stages)
                bar.refresh()
                return status
            if time.monotonic() - started > timeout_s:
                raise CliError(f"{name} is still {status['state']} after {timeout_s:.0f} s")
            time.sleep(poll_s)


def ask(name: str, message: str, *, max_tokens: int, serve_url: str, timeout_s: float) -> dict[str, Any]:
    """One chat request to the served pair ``<name>-eagle`` (waiting while its rollout is under way), with the
    evaluation's figures from the service."""
    import httpx

    status = call("GET", f"/v1/targets/{name}")
    if status["state"] != "ready":
        raise CliError(f"{name} is {status['state']}, not ready")
    body = {"model": f"{name}-eagle", "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            response = httpx.post(serve_url.rstrip("/") + "/v1/chat/completions", json=body, timeout=600)
            if response.status_code == 200:
                reply = response.json()
                eagle = reply.get("eagle") or {}
                return {"reply": reply["choices"][0]["message"]["content"], "tau": eagle.get("tau"),
                        "eval_tau": status["tau"], "eval_speedup": status["speedup"], "head_version": status["production_head"]}
            last = f"{response.status_code} {response.text[:200]}"
            if response.status_code not in (404, 503):
                break
        except httpx.HTTPError as err:
            last = type(err).__name__
        time.sleep(3)
    raise CliError(f"{serve_url}: {body['model']} did not answer ({last})")


def targets_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="eaglectl targets", description="Onboard and operate targets through the platform service.")
    sub = parser.add_subparsers(dest="command", required=True)
    onboard = sub.add_parser("onboard", help="register a target and train, gate and serve its head")
    onboard.add_argument("name")
    onboard.add_argument("--source", required=True, help="builtin:<name> or a model directory under an allowed root")
    onboard.add_argument("--preset", default=None)
    onboard.add_argument("--tau-gate", type=float, default=None)
    onboard.add_argument("--wait", action="store_true", help="wait until ready or failed, with progress")
    listing = sub.add_parser("list", help="every target and its state")
    status = sub.add_parser("status", help="one target's state, stage, jobs, run and tau")
    status.add_argument("name")
    status.add_argument("--wait", action="store_true")
    for command in ("retrain", "retire", "rollback"):
        sub.add_parser(command).add_argument("name")
    asking = sub.add_parser("ask", help="one chat request to the target's served pair, with the evaluation's tau and speedup")
    asking.add_argument("name")
    asking.add_argument("message")
    asking.add_argument("--max-tokens", type=int, default=64)
    asking.add_argument("--serve-url", default=os.environ.get("EAGLE_SERVE_URL", "http://127.0.0.1:8000"))
    asking.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the pair to come up")
    promote = sub.add_parser("promote", help="production to a given head version (manual override)")
    promote.add_argument("name")
    promote.add_argument("version")
    for each in (onboard, listing, status, *[sub.choices[c] for c in ("retrain", "retire", "rollback")], promote, asking):
        each.add_argument("--json", action="store_true", help="print the API's JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "onboard":
            body = {"name": args.name, "source": args.source, "preset": args.preset, "tau_gate": args.tau_gate}
            result = call("POST", "/v1/targets", {k: v for k, v in body.items() if v is not None})
            if args.wait:
                result = wait(args.name)
        elif args.command == "list":
            result = call("GET", "/v1/targets")
        elif args.command == "status":
            result = wait(args.name) if args.wait else call("GET", f"/v1/targets/{args.name}")
        elif args.command == "ask":
            result = ask(args.name, args.message, max_tokens=args.max_tokens, serve_url=args.serve_url, timeout_s=args.timeout)
        elif args.command == "promote":
            result = call("POST", f"/v1/targets/{args.name}/promote", {"version": args.version})
        else:
            result = call("POST", f"/v1/targets/{args.name}/{args.command}")
    except CliError as err:
        sys.stderr.write(f"eaglectl targets {args.command}: error: {err}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    elif args.command == "list":
        for status in result["targets"]:
            sys.stdout.write(line(status) + "\n")
    elif args.command == "ask":
        sys.stdout.write(result["reply"].strip() + "\n")
        figures = [f"head v{result['head_version']}"]
        if result["tau"] is not None:
            figures.append(f"tau of this reply {result['tau']:.2f}")
        if result["eval_tau"] is not None:
            figures.append(f"evaluation: tau {result['eval_tau']:.2f}")
        if result["eval_speedup"] is not None:
            figures.append(f"speedup {result['eval_speedup']:.2f}x over plain decoding (fp32)")
        sys.stderr.write("; ".join(figures) + "\n")
    else:
        sys.stdout.write(line(result) + "\n")
    return 1 if args.command in ("onboard", "status") and args.wait and result["state"] != "ready" else 0


def platform_main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "serve":
        sys.stderr.write("usage: eaglectl platform serve [service flags]  (see python -m eagle_platform.service --help)\n")
        return 2
    from eagle_platform.service import main

    return main(argv[1:])
