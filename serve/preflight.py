"""Check a Serve config before deploying it: ``python -m serve.preflight serve/config.yaml``.

Validates every application's ``args`` against ``serve.app.AppArgs``, resolves each pair's target, and asks the
registry for each ``models:/`` head, so a missing alias fails here in one line (exit 2) instead of as a
replica crash loop inside Serve. ``make serve`` runs it first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

import yaml
from pydantic import ValidationError

logger = logging.getLogger(__name__)


class PreflightError(Exception):
    pass


def check(config_path: str) -> list[str]:
    """One line per pair that is ready; raises PreflightError with a one-line reason otherwise."""
    from eagle.errors import EagleError
    from eagle.head import check_revision
    from eagle.target import resolve_target
    from serve.app import AppArgs

    try:
        with open(config_path) as handle:
            config = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as err:
        raise PreflightError(f"{config_path}: {str(err).splitlines()[0]}") from None
    applications = (config or {}).get("applications") or []
    if not applications:
        raise PreflightError(f"{config_path}: no applications")
    ready = []
    for application in applications:
        name = application.get("name", "?")
        if application.get("import_path") != "serve.app:build_app":
            continue
        try:
            args = AppArgs.model_validate(application.get("args") or {})
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise PreflightError(f"{config_path}: application {name!r}: {where}: {first.get('msg')}") from None
        env = ((application.get("runtime_env") or {}).get("env_vars") or {})
        tracking = args.tracking_uri or env.get("MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
        for pair in args.pairs:
            try:
                _, target_name, revision = resolve_target(pair.target)
            except EagleError as err:
                raise PreflightError(f"pair {pair.model!r}: {err}") from None
            head = "none (the target alone)"
            if pair.head and pair.head.startswith("models:/"):
                from eagle_platform.registry import Registry, parse_models_uri

                try:
                    model, alias, version = parse_models_uri(pair.head)
                    info = Registry(tracking).head_version_info(model, alias, version=version)
                except ValueError as err:
                    raise PreflightError(
                        f"pair {pair.model!r}: {str(err).splitlines()[0]} (a head is registered by `make quickstart` "
                        "or jobs.train_head, and promoted to @production by jobs.evaluate --promote-tau)"
                    ) from None
                try:
                    check_revision(pair.head, info["tags"].get("target_revision"), (target_name, revision))
                except EagleError as err:
                    raise PreflightError(f"pair {pair.model!r}: {err}") from None
                head = f"{pair.head} -> version {info['version']}"
            elif pair.head:
                if not os.path.isdir(pair.head):
                    raise PreflightError(f"pair {pair.model!r}: head directory {pair.head} does not exist")
                head = pair.head
            ready.append(f"{name}/{pair.model}: target {target_name} ({revision}), head {head}")
    return ready


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="serve/config.yaml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        for line in check(args.config):
            sys.stderr.write(f"preflight: {line}\n")
    except PreflightError as err:
        sys.stderr.write(f"preflight: error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
