# Sourced by the infra/local scripts (REPO_ROOT set): put the project's venv first on PATH unless the caller
# already has `ray`, `mlflow` and a `python` beside `ray` on it (an active venv; the Makefile puts .venv/bin
# first), so the scripts' bare `python`, `ray`, `serve` and `mlflow` are the project's.
_ray="$(command -v ray 2>/dev/null || true)"
_python="$(command -v python 2>/dev/null || true)"
if [[ -z "$_ray" || -z "$_python" || "$(dirname "$_ray")" != "$(dirname "$_python")" ]] \
        || ! command -v mlflow >/dev/null 2>&1; then
    if [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
        export PATH="$REPO_ROOT/.venv/bin:$PATH"
    fi
fi
unset _ray _python
