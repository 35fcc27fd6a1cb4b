"""`serve deploy` (and `make serve`'s infra/local/serve.sh) of the repository's serve/config.yaml onto the local stack (a Ray head with token
authentication + MLflow, infra/local/stack.sh on free ports), with the SmolLM2 pair from the registry.

The config is deployed as written except for what a test must change: the HTTP port and the MLflow URI
(free ports), eager decoders (compile off: the compiled path has its own tests), and fp32 instead of bf16 (exact equality with plain decoding is an fp32 property). A head is
registered and promoted to @production first, as training + evaluation would. At T=0 the EAGLE pair and the
target-alone pair both return exactly what plain decoding of SmolLM2 returns; the preflight check refuses a
config whose alias does not exist, in one line. Then infra/local/serve.sh runs the same config in the
foreground against the running stack; Ctrl-C (SIGINT) removes the app and leaves the stack it did not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from serve_helpers import plain_text, register_head
from stack_helpers import BIN, ROOT, client_env, mlflow_credentials, stack, stack_env
from mlflow_server import free_port

pytestmark = pytest.mark.e2e

DEFAULT_SIGINT_THEN_EXEC = (  # SIGINT, SIGPIPE and SIGXFSZ at their defaults (Python ignores the last two), then exec argv[1:]
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ): signal.signal(s, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def deploy_config(tmp_path, http_port: int, tracking: str) -> str:
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    config["http_options"]["port"] = http_port
    application = config["applications"][0]
    application["runtime_env"]["env_vars"]["MLFLOW_TRACKING_URI"] = tracking
    for pair in application["args"]["pairs"]:
        pair["dtype"] = "float32"
        pair["compile"] = "off"  # the compiled path has its own tests; compiling SmolLM2 in every replica costs minutes
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def answers(base: str) -> bool:
    try:
        return httpx.get(base + "/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_models(base: str, timeout: float = 420) -> dict:
    """/v1/models once every pair reports its info (replicas up), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    models = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(base + "/v1/models", timeout=10)
            if response.status_code == 200:
                models = response.json()
                if all("error" not in m["eagle"] for m in models["data"]):
                    return models
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"the deployment never answered with every pair up: {models}")


def test_serve_deploy_of_the_repo_config_serves_the_registered_pair(tmp_path, smollm2, monkeypatch):
    from eagle.head import EagleHead

    env, ports = stack_env(tmp_path / "stack", num_cpus=2)
    tracking = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
    http_port = free_port()
    config = deploy_config(tmp_path, http_port, tracking)
    base = f"http://127.0.0.1:{http_port}"
    try:
        up = stack("up", env)
        assert up.returncode == 0, up.stderr
        cli = client_env(env, tmp_path / "stack")

        preflight = subprocess.run([str(BIN / "python"), "-m", "serve.preflight", config], env=cli, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert preflight.returncode == 2 and preflight.stderr.count("\n") == 1, preflight.stderr
        assert "preflight: error: pair 'smollm2-135m-eagle'" in preflight.stderr

        monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
        monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
        head_dir = EagleHead.for_target(smollm2, seed=0).save_pretrained(tmp_path / "head")
        with mlflow_credentials(cli):  # the stack's MLflow needs them
            version = register_head(head_dir, smollm2)
        preflight = subprocess.run([str(BIN / "python"), "-m", "serve.preflight", config], env=cli, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert preflight.returncode == 0, preflight.stderr

        deploy = subprocess.run([str(BIN / "serve"), "deploy", config, "-a", cli["RAY_API_SERVER_ADDRESS"]], env=cli, cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr

        models = wait_for_models(base)
        by_id = {m["id"]: m["eagle"] for m in models["data"]}
        assert set(by_id) == {"smollm2-135m-eagle", "smollm2-135m"}
        assert by_id["smollm2-135m-eagle"]["head_version"] == version and by_id["smollm2-135m-eagle"]["speculative"]
        assert by_id["smollm2-135m"]["speculative"] is False

        messages = [{"role": "user", "content": "Name three primary colours."}]
        prompt_ids = smollm2.tokenizer.encode(
            smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        expected = plain_text(smollm2, prompt_ids, 24)
        for model in ("smollm2-135m-eagle", "smollm2-135m"):
            response = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}, timeout=300)
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["message"]["content"] == expected, model
            assert body["eagle"]["head_version"] == (version if model.endswith("-eagle") else None)
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 200, health.text
        shutdown = subprocess.run([str(BIN / "serve"), "shutdown", "-y", "-a", cli["RAY_API_SERVER_ADDRESS"]], env=cli, cwd=ROOT,
                                  capture_output=True, text=True, timeout=180)
        assert shutdown.returncode == 0, shutdown.stderr
        assert not answers(base)

        # `make serve`: the stack is up, so serve.sh only runs the app; Ctrl-C removes it, the stack stays
        log = open(tmp_path / "serve.log", "w")
        # Ctrl-C of a foreground `make serve`: SIGINT at its default in the script (a shell's background job, such as
        # a pytest started with `&`, ignores it, and so would every process it starts; bash cannot reset that)
        runner = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGINT_THEN_EXEC, "bash", str(ROOT / "infra" / "local" / "serve.sh"), config],
                                  env=cli, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_models(base)
            chat = httpx.post(base + "/v1/chat/completions", json={"model": "smollm2-135m-eagle", "messages": messages, "max_tokens": 24, "temperature": 0}, timeout=300)
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == expected
        finally:
            os.killpg(runner.pid, signal.SIGINT)
            try:  # serve run removes the app, the EXIT trap runs, bash exits (minutes on a loaded 2-core host)
                runner.wait(timeout=420)
            except subprocess.TimeoutExpired:
                os.killpg(runner.pid, signal.SIGKILL)
                raise
            finally:
                log.close()
        deadline = time.monotonic() + 60
        while answers(base) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not answers(base), (tmp_path / "serve.log").read_text()[-3000:]
        status = stack("status", env, timeout=60)
        assert status.returncode == 0, status.stdout  # serve.sh did not start the stack, so it left it running
    finally:
        cli = client_env(env, tmp_path / "stack") if (tmp_path / "stack" / "stack.env").is_file() else env
        subprocess.run([str(BIN / "serve"), "shutdown", "-y", "-a", cli.get("RAY_API_SERVER_ADDRESS", "")], env=cli, cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
        down = stack("down", env, timeout=180)
    assert down.returncode == 0, down.stderr
