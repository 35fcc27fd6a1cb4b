"""The onboarding pipeline of a target version: its state machine, its Ray jobs, and the reconcile loop.

A target version moves through::

    registered -> preparing -> featurizing -> training -> evaluating -> ready | failed

One stage is one Ray job (``jobs.prepare_data``, ``jobs.featurize``, ``jobs.train_head``, ``jobs.evaluate``),
submitted through the Ray Jobs API with the submission id ``eagle-<target>-v<version>-<stage>-a<attempt>``:
the id is a function of the state, so a service that crashed between writing a state and submitting its job
submits the same id again, and Ray, which keeps every submission id it has seen, refuses a second job
(the reconciler then adopts the one that exists). ``attempt`` counts the pipelines of a version
(``retrain`` starts the next).

All state lives in MLflow and Ray, none only in this process: the state of a version is the ``eagle.*`` tags
of the target's model version (``STATE_TAGS``), its jobs are Ray's. ``Reconciler.reconcile_once`` reads
both and takes the next step, idempotently, so a service killed at any point and restarted adopts running
jobs and resumes where it stopped. A version registered in MLflow without ``eagle.state`` (registered
directly, not through the service) is adopted: its artifacts are downloaded as the target's source.

Scheduling: at most one pipeline per target at a time, and at most ``max_concurrent`` across targets;
versions beyond that wait in ``registered`` (the queue), oldest first.

The gate (after ``evaluating``): the evaluation runs the target and head in fp32 at temperature 0, drafting
every step (``--speculate always``: the gate measures the head, not this machine's costs), on the preset's
held-out prompts; the version is ``ready`` when tau >= the target's gate and every output equals
plain decoding, and then alias ``production`` of ``<target>-eagle`` moves to its head. Otherwise the version
is ``failed`` with the reason, and ``production`` stays where it was. Each promotion stamps the head
version with ``eagle.promoted_ms``; ``rollback`` moves ``production`` to the head promoted before it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle_platform.registry import PRODUCTION, Registry, RegistryError, head_model_name, is_complete

logger = logging.getLogger(__name__)

REGISTERED, READY, FAILED = "registered", "ready", "failed"
EXTERNAL = "external"  # a target version a job registered by itself (infra/local/pipeline.sh), outside any pipeline
STAGES: tuple[tuple[str, str], ...] = (
    ("preparing", "jobs.prepare_data"),
    ("featurizing", "jobs.featurize"),
    ("training", "jobs.train_head"),
    ("evaluating", "jobs.evaluate"),
)
STAGE_STATES = tuple(state for state, _ in STAGES)
STATES = (REGISTERED, *STAGE_STATES, READY, FAILED)
TERMINAL = (READY, FAILED)
TRAINING_EXPERIMENT = "eagle-heads"  # jobs.train_head's experiment
EVAL_PREFIX = "eval/float32-T0"  # what the gate's evaluation logs (jobs.evaluate --dtype float32 --temperature 0)

# the tags of a target model version that hold its pipeline
TAG = "eagle."
STATE_TAGS = ("state", "reason", "source", "preset", "tau_gate", "attempt", "jobs", "run_id", "head_version",
              "tau", "speedup", "outputs_match_plain", "onboarded_by", "stage_started_ms", "updated_ms")
RETIRED_TAG = TAG + "retired"  # on a version: the target was retired; reconcile leaves it alone
PROMOTED_TAG = TAG + "promoted_ms"  # on a head version: when it became production
ROLLED_BACK_TAG = TAG + "rolled_back_ms"  # on a head version: rolled back from production

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_JOB_ERROR = re.compile(r"^[\w.]+: error: ")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b(: .*)?$")
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
BUILTIN_PREFIX = "builtin:"


class PipelineError(ValueError):
    """A request the pipeline refuses; ``status`` is the HTTP status the API answers with, ``field`` the
    request field at fault (None when it is not one field)."""

    def __init__(self, message: str, *, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


def claim_revision(registry: Registry, name: str, version: str, revision: str) -> None:
    """Make ``version`` the target's version for ``revision`` (the data stage, ``jobs.prepare_data
    --claim-version``), so that the training job's ``register_target`` finds it. A version that held the
    revision before (registered by a job outside the service, or an earlier onboarding that failed or
    finished) gives it up and keeps it as ``superseded_revision``; one whose pipeline is queued or running
    does not, and the claim fails."""
    holder = registry.target_version(name, revision)
    if holder is not None and holder != str(version):
        tags = next(v["tags"] for v in registry.versions(name) if v["version"] == holder)
        if tags.get(TAG + "state") in (REGISTERED, *STAGE_STATES) and tags.get(RETIRED_TAG) != "1":
            raise RegistryError(f"{name} revision {revision} belongs to version {holder}, whose pipeline is {tags[TAG + 'state']}")
        registry.set_version_tags(name, holder, {"superseded_revision": revision})
        registry.delete_version_tag(name, holder, "target_revision")
        logger.info("%s revision %s moves from version %s to %s", name, revision, holder, version)
    registry.claim_target_version(name, version, revision)


def submission_id(target: str, version: str, state: str, attempt: int) -> str:
    """The Ray submission id of a stage's job: one per (target, version, stage, attempt)."""
    return f"eagle-{target}-v{version}-{state}-a{attempt}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or name.endswith("-eagle"):
        raise PipelineError(
            f"bad target name {name!r}: lower-case letters, digits, '.', '_' and '-', at most 63, not ending in '-eagle'",
            field="name",
        )
    return name


@dataclass
class Settings:
    """How the pipeline runs its jobs (``python -m eagle_platform.service`` sets these from its flags)."""

    state_dir: Path  # downloaded sources and links named after their targets (a cache: rebuilt when lost)
    allowed_roots: tuple[Path, ...] = ()  # local source directories must lie under one of these
    builtin_targets: tuple[str, ...] = ("smollm2-135m",)
    presets: tuple[str, ...] = ()  # allowed preset names (jobs.presets.PRESETS, filled by the service)
    preset_gates: dict[str, float] = field(default_factory=dict)  # a preset's gate when the onboarding names none
    default_preset: str = "quick"
    default_tau_gate: float = 1.0  # for presets with no gate of their own (tau >= 1 always: fp32 exactness decides)
    max_concurrent: int = 1  # pipelines running at once, all targets together
    storage: str | None = None  # --storage of every job (default: the jobs' own, $EAGLE_STORAGE or the cache)
    job_env: dict[str, str] = field(default_factory=dict)  # env_vars of every job's runtime_env
    eval_prompts: int | None = None  # --prompts of the gate's evaluation (default: the preset's)
    eval_max_new_tokens: int | None = None
    eval_compile: str | None = None  # --compile of the gate's evaluation (default: the preset's)


class Reconciler:
    """Drives every target version's pipeline from what MLflow and Ray hold (see the module docstring).

    ``jobs`` is a ``ray.job_submission.JobSubmissionClient``; ``on_ready(name)`` is called after a version
    becomes ready or production moves (the service rolls the pair out from there).
    """

    def __init__(self, registry: Registry, jobs, settings: Settings, *, on_ready: Callable[[str], None] | None = None):
        self.registry = registry
        self.jobs = jobs
        self.settings = settings
        self.on_ready = on_ready
        self._lock = threading.RLock()  # one onboarding / reconcile step at a time in this process

    # ---------------------------------------------------------------------------------- reads

    def targets(self) -> list[str]:
        """Every target model (a registered model that is not a head model), retired ones included."""
        return sorted(m["name"] for m in self.registry.models() if not m["name"].endswith("-eagle"))

    def versions(self, name: str) -> list[dict[str, Any]]:
        """The versions of target ``name`` with their pipeline state (``pipeline``), oldest first; a version
        whose registration never finished (``registry.is_complete``) is not one."""
        out = []
        for version in self.registry.versions(name):
            if not is_complete(version):
                continue
            tags = version["tags"]
            state = {key: tags.get(TAG + key) for key in STATE_TAGS}
            state["attempt"] = int(state["attempt"] or 0)
            state["jobs"] = json.loads(state["jobs"]) if state["jobs"] else {}
            for key in ("tau", "speedup", "tau_gate"):
                state[key] = float(state[key]) if state[key] not in (None, "") else None
            if state["outputs_match_plain"] is not None:
                state["outputs_match_plain"] = state["outputs_match_plain"] == "1"
            state["retired"] = tags.get(RETIRED_TAG) == "1"
            out.append({**version, "pipeline": state})
        return out

    def status(self, name: str) -> dict[str, Any]:
        """What ``eaglectl targets status NAME --json`` prints (docs: platform/README.md "Status")."""
        check_name(name)  # 400 for a bad name before any registry read
        # the alias before the tags: the gate's results are tagged before the alias moves (``_after_stage``),
        # so a reader that sees a new production head also sees the results that promoted it
        production = self.registry.alias_version(head_model_name(name), PRODUCTION)
        versions = self._known(name)
        current = versions[-1]
        pipeline = current["pipeline"]
        out = {
            "name": name,
            "version": current["version"],
            "state": pipeline["state"] or (EXTERNAL if current["tags"].get("kind") == "target" else REGISTERED),
            "stage": pipeline["state"] if pipeline["state"] in STAGE_STATES else None,
            "reason": pipeline["reason"],
            "attempt": pipeline["attempt"],
            "preset": pipeline["preset"],
            "source": pipeline["source"],
            "tau_gate": pipeline["tau_gate"],
            "tau": pipeline["tau"],
            "speedup": pipeline["speedup"],
            "outputs_match_plain": pipeline["outputs_match_plain"],
            "jobs": pipeline["jobs"],
            "run_id": pipeline["run_id"],
            "head_version": pipeline["head_version"],
            "production_head": production,
            "retired": pipeline["retired"],
            "versions": [{"version": v["version"], "state": v["pipeline"]["state"], "attempt": v["pipeline"]["attempt"]} for v in versions],
        }
        if out["stage"]:
            out["progress"] = self._progress(name, current)
        return out

    def _progress(self, name: str, version: dict[str, Any]) -> dict[str, Any]:
        pipeline = version["pipeline"]
        sid = pipeline["jobs"].get(pipeline["state"])
        started = int(pipeline["stage_started_ms"] or 0)
        progress: dict[str, Any] = {"job": sid, "job_status": None, "elapsed_s": round(time.time() - started / 1000, 1) if started else None}
        if sid:
            info = self._job_info(sid)
            progress["job_status"] = info.status.value if info is not None else None
        if pipeline["state"] == "training":
            run_id = self.registry.runs.find_run(TRAINING_EXPERIMENT, self._run_name(name, version))
            if run_id:
                metrics = self.registry.runs.run_info(run_id)["metrics"]
                progress["run_id"] = run_id
                progress["metrics"] = {k: v for k, v in sorted(metrics.items()) if k.startswith("train/")}
        return progress

    # ------------------------------------------------------------------------------- requests

    def onboard(self, name: str, source: str, preset: str | None = None, tau_gate: float | None = None) -> dict[str, Any]:
        """Register a new version of target ``name`` from ``source`` and queue its pipeline; idempotent: while
        a version from the same source is queued, running or ready, the call returns its status."""
        check_name(name)
        preset = preset or self.settings.default_preset
        if preset not in self.settings.presets:
            raise PipelineError(f"unknown preset {preset!r}; expected one of {', '.join(self.settings.presets)}", field="preset")
        if tau_gate is None:
            tau_gate = self.settings.preset_gates.get(preset, self.settings.default_tau_gate)
        tau_gate = float(tau_gate)
        if not 1.0 <= tau_gate <= 64.0:
            raise PipelineError(f"tau_gate must be within [1, 64], got {tau_gate}", field="tau_gate")
        spec = self._check_source(name, source)
        with self._lock:
            for version in reversed(self.versions(name)):
                pipeline = version["pipeline"]
                if pipeline["source"] == spec and pipeline["state"] != FAILED and not pipeline["retired"]:
                    return self.status(name)
            tags = self._tags(state=REGISTERED, source=spec, preset=preset, tau_gate=tau_gate, attempt=1, jobs={}, onboarded_by="api")
            version = self.registry.onboard_target(name, {"source": spec, "preset": preset}, tags)
        logger.info("onboarded %s version %s from %s (preset %s, tau gate %.2f)", name, version, source, preset, tau_gate)
        return self.status(name)

    def retrain(self, name: str) -> dict[str, Any]:
        """Start the next attempt of the target's newest version (its data and features are reused)."""
        with self._lock:
            version = self._current(name)
            pipeline = version["pipeline"]
            if pipeline["state"] in STAGE_STATES or pipeline["state"] == REGISTERED:
                raise PipelineError(f"{name} version {version['version']} is {pipeline['state']}: nothing to retrain yet", status=409)
            self._clear(name, version["version"])
            self._set(name, version["version"], state=REGISTERED, attempt=pipeline["attempt"] + 1, jobs={}, reason="")
        return self.status(name)

    def retire(self, name: str) -> dict[str, Any]:
        """Stop the target's running job, take it out of the queue and out of the reconcile loop."""
        with self._lock:
            for version in self.versions(name):
                pipeline = version["pipeline"]
                sid = pipeline["jobs"].get(pipeline["state"] or "")
                if sid and pipeline["state"] in STAGE_STATES:
                    self._stop(sid)
                if pipeline["state"] not in TERMINAL:
                    self._set(name, version["version"], state=FAILED, reason="retired")
                self.registry.set_version_tags(name, version["version"], {RETIRED_TAG: "1"})
        if self.on_ready:
            self.on_ready(name)
        return self.status(name)

    def promote(self, name: str, head_version: str) -> dict[str, Any]:
        """Manual override: ``production`` of ``<name>-eagle`` to ``head_version``."""
        self._current(name)
        heads = {v["version"] for v in self.registry.versions(head_model_name(name))}
        if str(head_version) not in heads:
            raise PipelineError(f"{head_model_name(name)} has no version {head_version}", status=404, field="version")
        self._promote(name, str(head_version))
        return self.status(name)

    def rollback(self, name: str) -> dict[str, Any]:
        """``production`` back to the head promoted before the current one."""
        self._current(name)
        heads = self.registry.versions(head_model_name(name))
        current = self.registry.alias_version(head_model_name(name), PRODUCTION)
        earlier = sorted(
            (int(v["tags"][PROMOTED_TAG]), v["version"]) for v in heads
            if v["tags"].get(PROMOTED_TAG) and not v["tags"].get(ROLLED_BACK_TAG) and v["version"] != current
        )
        if current is None or not earlier:
            raise PipelineError(f"{name} has no earlier production head to roll back to", status=409)
        previous = earlier[-1][1]
        self.registry.set_version_tags(head_model_name(name), current, {ROLLED_BACK_TAG: str(_now_ms())})
        self.registry.promote(name, previous, PRODUCTION)
        logger.info("%s: production rolled back from head %s to %s", name, current, previous)
        if self.on_ready:
            self.on_ready(name)
        return self.status(name)

    # ------------------------------------------------------------------------------ reconcile

    def reconcile_once(self) -> None:
        """One pass over every target: adopt new versions, advance running stages, start queued ones."""
        with self._lock:
            everything = {name: self.versions(name) for name in self.targets()}
            for name, versions in everything.items():
                for version in versions:
                    if version["pipeline"]["state"] is None and not version["pipeline"]["retired"]:
                        self._adopt(name, version)
            everything = {name: self.versions(name) for name in everything}
            for name, versions in everything.items():
                for version in versions:
                    if version["pipeline"]["state"] in STAGE_STATES and not version["pipeline"]["retired"]:
                        self._advance(name, version)
            everything = {name: self.versions(name) for name in everything}
            active = {name for name, vs in everything.items() if any(v["pipeline"]["state"] in STAGE_STATES for v in vs)}
            running = len(active)
            queue = sorted(
                ((int(v["created_ms"] or 0), name, v) for name, vs in everything.items() for v in vs
                 if v["pipeline"]["state"] == REGISTERED and not v["pipeline"]["retired"]),
                key=lambda item: (item[0], item[1], int(item[2]["version"])),
            )
            for _, name, version in queue:
                if running >= self.settings.max_concurrent:
                    break
                if name in active:
                    continue
                self._start_stage(name, version, STAGE_STATES[0])
                active.add(name)
                running += 1

    def _adopt(self, name: str, version: dict[str, Any]) -> None:
        """A version registered directly in MLflow: its artifacts become the target's source."""
        if version["tags"].get("kind") == "target":
            return  # registered by a job run outside the service (infra/local/pipeline.sh): not the service's to train
        try:
            path = self._download(name, version)
            spec = self._check_source(name, str(path), downloaded=True)
        except PipelineError as err:
            self._set(name, version["version"], state=FAILED, reason=f"source: {err}", onboarded_by="mlflow", attempt=1)
            return
        preset = self.settings.default_preset
        self._set(name, version["version"], state=REGISTERED, source=spec, preset=preset,
                  tau_gate=self.settings.preset_gates.get(preset, self.settings.default_tau_gate), attempt=1, jobs={}, onboarded_by="mlflow")
        logger.info("adopted %s version %s registered in MLflow (source %s)", name, version["version"], version["source"])

    def _advance(self, name: str, version: dict[str, Any]) -> None:
        pipeline = version["pipeline"]
        state = pipeline["state"]
        sid = pipeline["jobs"].get(state) or submission_id(name, version["version"], state, pipeline["attempt"])
        info = self._job_info(sid)
        if info is None:  # the state was written but the job never submitted (a crash in between)
            self._submit(name, version, state)
            return
        status = info.status.value
        if status in ("PENDING", "RUNNING"):
            return
        if status in ("FAILED", "STOPPED"):
            self._set(name, version["version"], state=FAILED, reason=f"{state}: job {sid} {status.lower()}: {self._job_reason(sid, info)}")
            logger.warning("%s version %s failed in %s (job %s)", name, version["version"], state, sid)
            return
        # SUCCEEDED
        try:
            done = self._after_stage(name, version, state)
        except (RegistryError, PipelineError) as err:
            self._set(name, version["version"], state=FAILED, reason=f"{state}: {err}")
            return
        if done is not None:  # the gate decided
            return
        following = STAGE_STATES[STAGE_STATES.index(state) + 1]
        self._start_stage(name, self._reload(name, version["version"]), following)

    def _after_stage(self, name: str, version: dict[str, Any], state: str) -> str | None:
        """What a finished stage leaves behind; returns the final state after the gate, else None."""
        number = version["version"]
        if state == "training":
            run_id = self.registry.runs.find_run(TRAINING_EXPERIMENT, self._run_name(name, version))
            if run_id is None:
                raise PipelineError(f"no MLflow run named {self._run_name(name, version)!r}")
            heads = [v for v in self.registry.versions(head_model_name(name)) if v["run_id"] == run_id and is_complete(v)]
            if not heads:
                raise PipelineError(f"run {run_id} registered no head")
            self._set(name, number, run_id=run_id, head_version=heads[-1]["version"])
            return None
        if state != "evaluating":
            return None
        pipeline = version["pipeline"]
        metrics = self.registry.runs.run_info(pipeline["run_id"])["metrics"]
        tau = metrics.get(f"{EVAL_PREFIX}/tau")
        match = metrics.get(f"{EVAL_PREFIX}/outputs_match_plain")
        speedup = metrics.get(f"{EVAL_PREFIX}/speedup_vs_plain")
        if tau is None or match is None:
            raise PipelineError(f"the evaluation logged no {EVAL_PREFIX}/tau to run {pipeline['run_id']}")
        gate = pipeline["tau_gate"] or self.settings.default_tau_gate
        results = {"tau": tau, "speedup": speedup if speedup is not None else "", "outputs_match_plain": "1" if match else "0"}
        if not match:
            self._set(name, number, state=FAILED, reason="gate: fp32 outputs differ from plain decoding", **results)
            return FAILED
        if tau < gate:
            self._set(name, number, state=FAILED, reason=f"gate: tau {tau:.3f} < {gate:.2f}", **results)
            return FAILED
        # results, then the alias, then the state: a crash in between redoes this gate on restart (the promote
        # is idempotent), and no reader sees the alias move before the results that passed the gate
        self._set(name, number, **results)
        self._promote(name, pipeline["head_version"], notify=False)
        self._set(name, number, state=READY, reason="")
        logger.info("%s version %s ready: head %s is production (tau %.3f >= %.2f)", name, number, pipeline["head_version"], tau, gate)
        if self.on_ready:
            self.on_ready(name)
        return READY

    def _start_stage(self, name: str, version: dict[str, Any], state: str) -> None:
        number = version["version"]
        sid = submission_id(name, number, state, version["pipeline"]["attempt"])
        jobs = {**version["pipeline"]["jobs"], state: sid}
        self._set(name, number, state=state, jobs=jobs, stage_started_ms=_now_ms())  # first the state, then the job
        self._submit(name, self._reload(name, number), state)

    def _submit(self, name: str, version: dict[str, Any], state: str) -> None:
        pipeline = version["pipeline"]
        sid = pipeline["jobs"][state]
        entrypoint = self._entrypoint(name, version, state)
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MLFLOW_TRACKING_URI": self.registry.uri, **self.settings.job_env}
        try:
            self.jobs.submit_job(entrypoint=entrypoint, submission_id=sid, runtime_env={"env_vars": env},
                                 metadata={"eagle_target": name, "eagle_version": str(version["version"]), "eagle_stage": state})
        except RuntimeError as err:
            if "already exists" not in str(err):
                raise
            logger.info("job %s exists already: adopted", sid)  # Ray refused a duplicate
            return
        logger.info("%s version %s: %s -> job %s", name, version["version"], state, sid)

    def _entrypoint(self, name: str, version: dict[str, Any], state: str) -> str:
        import shlex

        pipeline = version["pipeline"]
        module = dict(STAGES)[state]
        args = ["python", "-m", module, "--preset", pipeline["preset"], "--target", self.target_spec(name, version),
                "--dataset", f"{pipeline['preset']}-v{version['version']}"]
        if self.settings.storage:
            args += ["--storage", self.settings.storage]
        if state == "preparing":
            args += ["--claim-version", str(version["version"])]
        elif state == "training":
            args += ["--run-name", self._run_name(name, version)]
        elif state == "evaluating":
            args += ["--head", f"models:/{head_model_name(name)}/{pipeline['head_version']}", "--dtype", "float32", "--temperature", "0",
                     "--speculate", "always"]  # the gate measures the head's acceptance, not this machine's costs
            for flag, value in (("--prompts", self.settings.eval_prompts), ("--max-new-tokens", self.settings.eval_max_new_tokens),
                                ("--compile", self.settings.eval_compile)):
                if value is not None:
                    args += [flag, str(value)]
        return shlex.join(args)

    def _promote(self, name: str, head_version: str, *, notify: bool = True) -> None:
        head_name = head_model_name(name)
        if self.registry.alias_version(head_name, PRODUCTION) == head_version:
            return
        self.registry.set_version_tags(head_name, head_version, {PROMOTED_TAG: str(_now_ms())})
        self.registry.delete_version_tag(head_name, head_version, ROLLED_BACK_TAG)
        self.registry.promote(name, head_version, PRODUCTION)
        if notify and self.on_ready:
            self.on_ready(name)

    # --------------------------------------------------------------------------------- sources

    def _check_source(self, name: str, source: str, *, downloaded: bool = False) -> str:
        """The target spec the jobs get for ``source`` (a built-in name, or a link named ``name`` to the
        directory); refuses anything outside the allowed roots, without safetensors, or with remote code."""
        if not isinstance(source, str) or not source:
            raise PipelineError("source is required", field="source")
        if source.startswith(BUILTIN_PREFIX):
            builtin = source[len(BUILTIN_PREFIX):]
            if builtin not in self.settings.builtin_targets:
                raise PipelineError(f"unknown built-in target {builtin!r}; expected one of {', '.join(self.settings.builtin_targets)}", field="source")
            if builtin != name:
                raise PipelineError(f"the built-in target {builtin!r} is onboarded under its own name, not {name!r}", field="name")
            return builtin
        path = Path(source)
        if not path.is_absolute():
            raise PipelineError(f"source {source!r}: expected builtin:<name> or an absolute directory path", field="source")
        real = path.resolve()
        roots = (self.settings.state_dir.resolve() / "sources",) if downloaded else tuple(r.resolve() for r in self.settings.allowed_roots)
        if not any(real == root or root in real.parents for root in roots):
            raise PipelineError(f"source {source!r} is outside the allowed roots", status=403, field="source")
        if not (real / "config.json").is_file():
            raise PipelineError(f"source {source!r} has no config.json", field="source")
        if not any(real.glob("*.safetensors")):
            raise PipelineError(f"source {source!r} has no *.safetensors weights (pickles are not loaded)", field="source")
        if any(real.glob("*.bin")) or any(real.glob("*.pt")) or any(real.glob("*.pkl")):
            raise PipelineError(f"source {source!r} holds pickle files; only safetensors are accepted", field="source")
        try:
            config = json.loads((real / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise PipelineError(f"source {source!r}: config.json is not JSON ({err})", field="source") from None
        if not isinstance(config, dict) or config.get("auto_map") or any(real.glob("*.py")):
            raise PipelineError(f"source {source!r} needs remote code (auto_map / *.py); trust_remote_code is never used", field="source")
        return str(real)

    def target_spec(self, name: str, version: dict[str, Any]) -> str:
        """A built-in name, or a link ``<state>/links/v<version>/<name>`` to the source (the jobs name a
        directory target after its folder)."""
        source = version["pipeline"]["source"]
        if not source.startswith("/"):
            return source
        link = self.settings.state_dir / "links" / f"v{version['version']}" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink() or Path(link.resolve()) != Path(source):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(source, target_is_directory=True)
        return str(link)

    def _download(self, name: str, version: dict[str, Any]) -> Path:
        import mlflow.artifacts

        dest = self.settings.state_dir / "sources" / name / f"v{version['version']}"
        dest.mkdir(parents=True, exist_ok=True)
        try:  # into dest/<the artifact folder's name>
            path = mlflow.artifacts.download_artifacts(artifact_uri=version["source"], dst_path=str(dest), tracking_uri=self.registry.uri)
        except Exception as err:  # noqa: BLE001 - any download failure is the version's failure
            raise PipelineError(f"cannot download {version['source']}: {err}") from None
        return Path(path)

    # ---------------------------------------------------------------------------------- helpers

    def _known(self, name: str) -> list[dict[str, Any]]:
        """The versions of target ``name``, oldest first; 400 for a bad name, 404 when there is none."""
        check_name(name)
        versions = self.versions(name)
        if not versions:
            raise PipelineError(f"unknown target {name!r}", status=404, field="name")
        return versions

    def _current(self, name: str) -> dict[str, Any]:
        return self._known(name)[-1]

    def _reload(self, name: str, number: str) -> dict[str, Any]:
        return next(v for v in self.versions(name) if v["version"] == number)

    @staticmethod
    def _run_name(name: str, version: dict[str, Any]) -> str:
        return f"{name}-v{version['version']}-a{version['pipeline']['attempt']}"

    @staticmethod
    def _tags(**values: Any) -> dict[str, str]:
        tags = {TAG + key: (json.dumps(value) if isinstance(value, (dict, list)) else str(value)) for key, value in values.items()}
        tags[TAG + "updated_ms"] = str(_now_ms())
        return tags

    def _set(self, name: str, number: str, **values: Any) -> None:
        """Write pipeline tags; MLflow sets them one call each, so the state goes last: a reader that sees
        ``ready`` (or ``failed``) also sees the tau and reason written with it."""
        tags = self._tags(**values)
        state = {key: tags.pop(key) for key in [TAG + "state"] if key in tags}
        self.registry.set_version_tags(name, number, {**tags, **state})

    def _clear(self, name: str, number: str) -> None:
        for key in ("run_id", "head_version", "tau", "speedup", "outputs_match_plain"):
            self.registry.delete_version_tag(name, number, TAG + key)

    def _job_info(self, sid: str):
        try:
            return self.jobs.get_job_info(sid)
        except RuntimeError as err:
            if "does not exist" in str(err) or "not found" in str(err).lower() or "404" in str(err):
                return None
            raise

    def _job_reason(self, sid: str, info) -> str:
        """Why a job failed: its one-line ``<job>: error: ...`` (how the jobs report bad input), else the last
        exception line of a traceback, else Ray's message."""
        try:
            lines = [_ANSI.sub("", line).strip() for line in self.jobs.get_job_logs(sid).splitlines()]
        except RuntimeError:
            lines = []
        ours = [line for line in lines if _JOB_ERROR.match(line)]
        raised = [line for line in lines if _EXCEPTION.match(line)]
        return (ours or raised or [info.message or "no log"])[-1][:500]

    def _stop(self, sid: str) -> None:
        try:
            self.jobs.stop_job(sid)
        except RuntimeError as err:
            logger.warning("could not stop job %s: %s", sid, err)


def _now_ms() -> int:
    return int(time.time() * 1000)

