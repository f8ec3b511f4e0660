"""Model control across the fleet (Triton's model repository extension): load or unload a model on
the fleet's workers through Celery's remote control, and the repository index.

A load is broadcast to the workers named, else to every live device worker: those that answer
``ping`` and those the model catalogue lists as hosting something (a worker busy loading answers
no ping). An unload goes to the workers named, else to every worker the catalogue lists as hosting
the model. Each worker answers when it is done (worker/model_control.py); the call waits for every
answer up to ``timeout_s`` and reports each worker's outcome, a failure with its reason, and the
workers that did not answer in time (their load or unload goes on; the catalogue and
``asyncinfer models`` show when it is done). A worker that is no device worker (a CPU stages'
worker) is skipped when no workers were named.

**A command goes only to a worker that listens.** On Redis, Celery's broadcast is a ``PUBLISH``:
a worker whose control channel is not subscribed at that moment never gets it, and nothing says
so — the caller would wait out its whole timeout for an answer that cannot come, and the worker
would do nothing. That moment exists: a starting worker is in the model catalogue (its models
ready, so the target of an unload) a few seconds before its Celery consumer subscribes, and a
worker whose consumer reconnects to the broker is deaf meanwhile. So each worker asked must first
answer a ``ping`` (the load's ping of the fleet counts; a ping lost the same way is sent again —
after ``ASK_TIMEOUT_S``, then twice as long each time, never more than a quarter of the time
left — until the timeout), and gets the command once it did; the workers that answered first do
not wait for the others. A worker that answered no ping
by the timeout is sent the command then, without waiting for its answer (one busy with another
load runs it when done), and is reported as not answering.

The index (:func:`repository_index`, Triton's ``RepositoryIndex``): every model the fleet knows,
one row per version — READY while a live worker hosts it; UNAVAILABLE, with the reason, when it is
known (announced within ``ASYNCINFER_MODEL_RETENTION_S``) but no live worker hosts it, or when a
live worker could load it and none has (the reason: each worker's failure, where its load failed
there, as a bad model file left out of a worker's default set).

:class:`ModelControl` is the :class:`~asyncinfer.client.client.Client`'s part that calls these:
``load_model``, ``unload_model`` and ``repository_index``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.wire import triton_words
from asyncinfer.wire.model_versions import split_key, version_order

if TYPE_CHECKING:
    from asyncinfer.client.brokers import BrokerGroup

__all__ = ["ModelControl", "WorkerOutcome", "ControlOutcome", "control", "targets_for",
           "repository_index", "LOAD", "UNLOAD", "READY", "UNAVAILABLE", "DEFAULT_CONTROL_TIMEOUT_S"]

LOAD, UNLOAD = "load", "unload"
READY, UNAVAILABLE = "READY", "UNAVAILABLE"
#: How long a load or unload waits for the workers' answers by default (seconds).
DEFAULT_CONTROL_TIMEOUT_S = 60.0
#: How long the workers have to answer a ping or the index's question (seconds).
ASK_TIMEOUT_S = 1.0
#: The longest wait for one round of pings to the workers a command waits for (seconds): the
#: first round waits ``ASK_TIMEOUT_S``, each next one twice as long, up to this.
MAX_ASK_S = 4.0
#: The shortest round of pings worth sending (seconds).
MIN_ASK_S = 0.05

_COMMANDS = {LOAD: "asyncinfer_load_model", UNLOAD: "asyncinfer_unload_model"}
_REPOSITORY = "asyncinfer_repository"


@dataclass(frozen=True)
class WorkerOutcome:
    """One worker's answer to a load or unload."""

    worker: str
    ok: bool
    error: str = ""
    reply: Mapping[str, Any] = field(default_factory=dict)

    @property
    def device_worker(self) -> bool:
        return self.reply.get("device_worker", True) is not False

    def as_dict(self) -> dict[str, Any]:
        return {**self.reply, "worker": self.worker, "ok": self.ok, "error": self.error}


@dataclass(frozen=True)
class ControlOutcome:
    """What the workers answered to a load or unload of ``model``."""

    model: str
    action: str
    #: The answers of the workers asked (those that are no device worker left out when no
    #: workers were named: :attr:`skipped`).
    answers: tuple[WorkerOutcome, ...] = ()
    #: Workers asked that did not answer within the timeout.
    missing: tuple[str, ...] = ()
    skipped: tuple[WorkerOutcome, ...] = ()
    #: Why no worker was asked at all (none live, none hosts it).
    nobody: str = ""
    #: The version acted on ("": the model, every version of it for an unload).
    version: str = ""

    @property
    def what(self) -> str:
        return f"model '{self.model}'" + (f" version '{self.version}'" if self.version else "")

    @property
    def ok(self) -> bool:
        """Every worker asked answered and did it (and at least one was asked)."""
        return bool(self.answers) and not self.missing and all(a.ok for a in self.answers)

    @property
    def failed(self) -> list[WorkerOutcome]:
        return [a for a in self.answers if not a.ok]

    def message(self) -> str:
        """One line: what was done where, each failure with its reason, who did not answer. A
        load or unload not done starts with Triton's words (``load failed for model 'm': ...``,
        ``failed to unload 'm': ...``)."""
        if self.nobody:
            return f"{self._failed_words()}: {self.nobody}"
        done = [a.worker for a in self.answers if a.ok]
        parts = []
        if done:
            parts.append(f"{self.action}ed on {', '.join(done)}")
        parts += [f"{a.worker}: {a.error}" for a in self.failed]
        if self.missing:
            parts.append(f"no answer within the timeout from {', '.join(self.missing)} (it may "
                         f"still be under way there)")
        if self.ok:
            return f"{self.action} of {self.what} done: " + "; ".join(parts)
        return f"{self._failed_words()}: " + "; ".join(parts)

    def _failed_words(self) -> str:
        words = (triton_words.load_failed if self.action == LOAD
                 else triton_words.unload_failed)(self.model)
        return f"{words} (version '{self.version}')" if self.version else words

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "action": self.action, "ok": self.ok,
                "message": self.message(), "workers": [a.as_dict() for a in self.answers],
                "missing": list(self.missing), "skipped": [a.worker for a in self.skipped]}


def _pongs(app: Celery, timeout_s: float, destination: Sequence[str] | None = None) -> set[str]:
    """The workers (of ``destination``; None: all) that answer a ping within ``timeout_s``."""
    replies = app.control.ping(destination=list(destination) if destination else None,
                               timeout=timeout_s) or []
    return {worker for reply in replies for worker in reply}


def targets_for(action: str, model: str, entries: Mapping[str, CatalogueEntry],
                live: Iterable[str], version: str = "") -> list[str]:
    """The workers a load (every live one) or an unload (those hosting ``model``, or that
    version of it) goes to when none are named."""
    if action == UNLOAD:
        entry = entries.get(model)
        if entry is None:
            return []
        return sorted({h.worker for h in (entry.hosts_of(version) if version else entry.hosts)})
    return sorted(set(live))


def outcomes_of(replies: Sequence[Mapping[str, Any]]) -> dict[str, WorkerOutcome]:
    """Celery's broadcast replies (``[{worker: reply}, ...]``) as outcomes, by worker."""
    found = {}
    for reply in replies:
        for worker, answer in reply.items():
            answer = answer if isinstance(answer, Mapping) else {"error": repr(answer)}
            ok = answer.get("ok") is True
            found[worker] = WorkerOutcome(worker, ok, "" if ok else str(answer.get("error", "?")),
                                          dict(answer))
    return found


def control(app: Celery, action: str, model: str, entries: Mapping[str, CatalogueEntry], *,
            workers: Sequence[str] = (), devices: Sequence[str] = (), version: str = "",
            timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
            grace_s: float | None = None, factory: str = "") -> ControlOutcome:
    """Load or unload ``model`` on ``workers`` (default: see the module documentation), or on the
    live device workers of ``devices`` (device labels: ``cuda:0``, ``cpu``), and wait up to
    ``timeout_s`` for their answers. ``grace_s``: how long an unload lets the requests on the
    device finish (default the worker's, 10 s). ``version``: that version only (a load:
    ``model@version`` as registered; an unload: the other versions serve on). ``factory``
    (a load): ``pkg.mod:attr``, which each worker imports and registers as ``model@version``
    first, where its ``ASYNCINFER_LOADABLE_FACTORIES`` allows the module."""
    if action not in _COMMANDS:
        raise ValueError(f"model control action must be {LOAD} or {UNLOAD}, got {action!r}")
    if factory and action != LOAD:
        raise ValueError("model control: a factory is named for a load only")
    if factory and (not isinstance(factory, str) or factory.count(":") != 1):
        raise ValueError(f"model control: a factory looks like 'package.module:factory', "
                         f"got {factory!r}")
    if not model or not isinstance(model, str):
        raise ValueError(f"model control: a model name is needed, got {model!r}")
    if workers and devices:
        raise ValueError("model control: name workers or devices, not both")
    deadline = time.monotonic() + timeout_s
    named = list(dict.fromkeys(w for w in workers if w))
    listening: set[str] = set()  # workers that just answered: their control channel is open
    if devices:
        wanted = set(devices)
        found_on = repositories(app)
        listening = set(found_on)
        named = sorted(w for w, info in found_on.items() if info.get("device") in wanted)
        if not named:
            return ControlOutcome(model, action, nobody=(
                f"no live device worker on {', '.join(sorted(wanted))} answered"))
    live: list[str] = []
    if action == LOAD and not named:  # every live worker: those that answer, those listed
        listening = _pongs(app, ASK_TIMEOUT_S)
        live = sorted(listening | {h.worker for e in entries.values() for h in e.hosts})
    targets = named or targets_for(action, model, entries, live, version)
    if not targets:
        return ControlOutcome(model, action, nobody=(
            "no live worker answered" if action == LOAD
            else "no live worker hosts it (the catalogue lists none)"), version=version)
    arguments: dict[str, Any] = {"model": model}
    if version:
        arguments["version"] = str(version)
    if factory:
        arguments["factory"] = factory
    if action == UNLOAD and grace_s is not None:
        arguments["grace_s"] = float(grace_s)
    found = _send_when_listening(app, _COMMANDS[action], arguments, targets, listening, deadline)
    answers = [found[w] for w in targets if w in found]
    skipped: list[WorkerOutcome] = []
    if not named:  # asked by default: a worker that runs no model is no failure
        skipped = [a for a in answers if not a.device_worker]
        answers = [a for a in answers if a.device_worker]
    return ControlOutcome(model, action, tuple(answers),
                          tuple(w for w in targets if w not in found), tuple(skipped),
                          version=version)


def _send_when_listening(app: Celery, command: str, arguments: Mapping[str, Any],
                         targets: Sequence[str], listening: set[str],
                         deadline: float) -> dict[str, WorkerOutcome]:
    """Send ``command`` to each of ``targets`` once it has answered a ping (``listening``: those
    that just answered one), and wait until ``deadline`` (``time.monotonic()``) for the answers;
    the outcomes, by worker (see the module documentation: a broadcast to a worker that does not
    listen is lost)."""
    found: dict[str, WorkerOutcome] = {}
    ready = [w for w in targets if w in listening]
    pending = [w for w in targets if w not in listening]
    wait_s, first = ASK_TIMEOUT_S, True
    while True:
        # a round of pings: who listens now (a round takes at most a quarter of the time left,
        # so that those that answer keep the rest for their command)
        round_s = min(wait_s, (deadline - time.monotonic()) / 4)
        if pending and (round_s >= MIN_ASK_S or first):
            first = False
            answered = _pongs(app, max(round_s, 0.0), pending)
            wait_s = min(2 * wait_s, MAX_ASK_S)
            ready += [w for w in pending if w in answered]
            pending = [w for w in pending if w not in answered]
        if ready:  # the command, to those that listen, all at once; their answers awaited
            replies = app.control.broadcast(
                command, arguments=dict(arguments), destination=sorted(ready), reply=True,
                timeout=max(deadline - time.monotonic(), 0.0), limit=len(ready)) or []
            found.update(outcomes_of(replies))
            ready = []
        if not pending or (deadline - time.monotonic()) / 4 < MIN_ASK_S:
            break
    if pending:  # never answered: told anyway (one busy elsewhere does it when free), not awaited
        app.control.broadcast(command, arguments=dict(arguments), destination=pending,
                              reply=False)
    return found


def repositories(app: Celery, entries: Mapping[str, CatalogueEntry] | None = None,
                 timeout_s: float = ASK_TIMEOUT_S) -> dict[str, Mapping[str, Any]]:
    """What each live device worker could load and has loaded, and its device, by worker: the
    hosts of the catalogue ``entries`` (they answer at once), or, without entries, every worker
    that answers within ``timeout_s``."""
    hosts = sorted({h.worker for e in entries.values() for h in e.hosts}) if entries is not None \
        else None
    if hosts == []:
        return {}
    replies = app.control.broadcast(_REPOSITORY, destination=hosts, reply=True, timeout=timeout_s,
                                    limit=len(hosts) if hosts else None) or []
    return {w: r for reply in replies for w, r in reply.items() if isinstance(r, Mapping) and r}


def repository_index(entries: Mapping[str, CatalogueEntry],
                     workers: Mapping[str, Mapping[str, Any]] | None = None, *,
                     ready_only: bool = False) -> list[dict[str, str]]:
    """Triton's repository index (``[{"name", "version", "state", "reason"}]``) of the catalogue
    ``entries`` and of what the live ``workers`` could load (:func:`repositories`), by name."""
    rows: list[dict[str, str]] = []
    for name, entry in entries.items():
        for version in entry.versions:
            ready = bool(entry.hosts_of(version))
            reason = "" if ready else ("no live worker hosts it (unloaded, or its workers "
                                       "stopped); its requests wait in its queue"
                                       if not entry.ready else
                                       "no live worker hosts this version (unloaded)")
            rows.append({"name": name, "version": version,
                         "state": READY if ready else UNAVAILABLE, "reason": reason})
    listed = {(r["name"], r["version"]) for r in rows}
    loadable: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {}
    for worker, info in (workers or {}).items():
        for key in info.get("loadable") or []:
            name, version = split_key(str(key))  # version v of m is registered as m@v
            if (name not in entries if not version else (name, version) not in listed):
                loadable.setdefault(str(key), []).append(worker)
        for key, why in (info.get("failed") or {}).items():
            failed.setdefault(str(key), []).append(f"{worker}: {why}")
    for key, where in loadable.items():
        name, version = split_key(key)
        reason = (f"failed to load ({'; '.join(sorted(failed[key]))})" if key in failed
                  else f"not loaded (loadable on {', '.join(sorted(where))})")
        rows.append({"name": name, "version": version, "state": UNAVAILABLE, "reason": reason})
    rows.sort(key=lambda r: (r["name"], version_order(r["version"])))
    return [r for r in rows if r["state"] == READY] if ready_only else rows


class ModelControl:
    """:class:`~asyncinfer.client.client.Client`'s model control calls."""

    if TYPE_CHECKING:  # the client's own
        def app_for(self, model: str) -> Celery: ...
        def apps(self) -> dict[str, Celery]: ...
        def _group_for(self, model: str | None) -> BrokerGroup: ...
        def models(self, *, stale_ok: bool = False) -> dict[str, CatalogueEntry]: ...

    def load_model(self, model: str, *, version: str | int | None = None,
                   workers: Sequence[str] = (), devices: Sequence[str] = (),
                   timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
                   factory: str | None = None) -> ControlOutcome:
        """Load ``model`` (``version``: that version, registered as ``model@version``) on
        ``workers`` (default: every live device worker), or on the workers of ``devices``
        (``cuda:0``, ``cpu``), and start serving it there; waits up to ``timeout_s`` for their
        answers. ``factory`` (``pkg.mod:attr``): a version no worker has registered yet, which
        each worker imports (where its ``ASYNCINFER_LOADABLE_FACTORIES`` allows the module),
        registers as ``model@version`` and loads beside the others. ``outcome.ok`` when every
        worker asked loaded it; ``outcome.message()`` says what failed where, and why."""
        return self._control(LOAD, model, version, workers, devices, timeout_s,
                             factory=factory or "")

    def unload_model(self, model: str, *, version: str | int | None = None,
                     workers: Sequence[str] = (), devices: Sequence[str] = (),
                     timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
                     grace_s: float | None = None) -> ControlOutcome:
        """Unload ``model`` (every version; ``version``: that one, the others serving on) from
        ``workers`` (default: every worker hosting it), or from the workers of ``devices``: each
        stops taking its queue, gives back what it holds and has not started, finishes what is
        on its device (up to ``grace_s``) and frees the memory."""
        return self._control(UNLOAD, model, version, workers, devices, timeout_s, grace_s)

    def _control(self, action: str, model: str, version: str | int | None,
                 workers: Sequence[str], devices: Sequence[str], timeout_s: float,
                 grace_s: float | None = None, factory: str = "") -> ControlOutcome:
        outcome = control(self.app_for(model), action, model, self.models(stale_ok=True),
                          workers=workers, devices=devices,
                          version="" if version is None else str(version),
                          timeout_s=timeout_s, grace_s=grace_s, factory=factory)
        group = self._group_for(model)
        if group.known is not None:  # the unknown-model check reads the catalogue again
            group.known.forget()
        return outcome

    def repository_index(self, *, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index of the fleet: every model it knows or could load, per
        version, with its state (READY, UNAVAILABLE) and why (:func:`repository_index`)."""
        entries = self.models(stale_ok=True)
        workers: dict[str, Any] = {}
        for app in self.apps().values():
            workers.update(repositories(app, entries))
        return repository_index(entries, workers, ready_only=ready_only)
