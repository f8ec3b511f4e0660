"""Names on the wire: the fixed part of the contract, in one place (Redis keys: asyncinfer/wire/keys.py)."""

from __future__ import annotations

__all__ = [
    "TASK_NAME",
    "PREPROCESS_TASK",
    "POSTPROCESS_TASK",
    "CPU_QUEUE",
    "CONTROL_QUEUE",
    "PIDBOX_SUFFIX",
    "serves_no_task",
    "QUEUE_PREFIX",
    "queue_for",
    "model_from_queue",
    "PRIORITY_SEP",
    "PRIORITY_STEPS",
    "level_of",
    "priority_lists",
    "priority_list",
    "queue_of_list",
    "sequence_list",
    "is_sequence_list",
]

#: The one task every producer sends; its task ID is the request ID.
TASK_NAME = "asyncinfer.infer"

#: A model's CPU stages as tasks of their own (the cross-worker pipeline), and their queue.
PREPROCESS_TASK = "asyncinfer.preprocess"
POSTPROCESS_TASK = "asyncinfer.postprocess"
CPU_QUEUE = "asyncinfer.cpu"
#: What Celery's own consumer listens on in a worker whose fast consumer takes the infer.* queues
#: (remote control, events and the worker's heartbeat go through Celery's consumer).
CONTROL_QUEUE = "asyncinfer.control"
#: How the queues of Celery's remote control (pidbox) end: replies and commands, never a task.
PIDBOX_SUFFIX = ".celery.pidbox"


def serves_no_task(queue: str) -> bool:
    """Whether ``queue`` is one where a worker serves no task: the control queue, or a queue of
    Celery's remote control (its commands and their replies)."""
    return queue == CONTROL_QUEUE or queue.endswith(PIDBOX_SUFFIX)


#: Requests for model ``M`` go to the Celery queue ``infer.M``.
QUEUE_PREFIX = "infer."




#: kombu's Redis transport keeps a queue's messages of priority step 3, 6, 9 in lists named
#: queue + PRIORITY_SEP + step (step 0: the queue's own list), and serves lower steps first.
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)


def priority_lists(queues: list[str]) -> list[str]:
    """The Redis lists of ``queues`` in the order kombu's BRPOP serves them (by step, then queue)."""
    return [q if step == 0 else f"{q}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS for q in queues]


def level_of(priority: int) -> int:
    """The level (kombu's priority step, the list it goes on) of a Celery priority 0-9."""
    if type(priority) is int:  # a publish asks up to four times: a look-up, not a search
        return _LEVELS[0 if priority < 0 else 9 if priority > 9 else priority]
    return max(s for s in PRIORITY_STEPS if s <= max(0, min(9, priority)))


#: The level of each priority 0-9 (``level_of``'s answer for an ``int``).
_LEVELS = tuple(max(s for s in PRIORITY_STEPS if s <= p) for p in range(10))


def priority_list(queue: str, priority: int) -> str:
    """The Redis list kombu's Redis transport puts a message of ``priority`` (0-9) on."""
    step = level_of(priority)
    return queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}"


def sequence_list(queue: str, holder: str) -> str:
    """The own list of worker process ``holder`` for the sequences of ``queue``'s model (the
    publish script pushes a pinned sequence's requests there): a list of the queue, as a priority
    list is, so that what is taken from it counts as the queue's."""
    return f"{queue}{PRIORITY_SEP}sequences {holder}"


def is_sequence_list(key: str) -> bool:
    """Whether Redis list ``key`` is a worker's own list of sequences (:func:`sequence_list`)."""
    return f"{PRIORITY_SEP}sequences " in key


def queue_of_list(key: str) -> str:
    """The queue a Redis list belongs to (its name without a priority suffix)."""
    return key.split(PRIORITY_SEP, 1)[0]




def queue_for(model: str) -> str:
    """Return the Celery queue that carries requests for ``model``."""
    return QUEUE_PREFIX + model


def model_from_queue(queue: str) -> str | None:
    """Return the model a queue carries, or None for a queue that is not an inference queue."""
    if queue.startswith(QUEUE_PREFIX) and len(queue) > len(QUEUE_PREFIX):
        return queue[len(QUEUE_PREFIX):]
    return None
