"""Processes and threads that must not outlive what they serve: a child that dies with its parent,
the supervisor of a worker's or gateway's child processes, a thread whose death ends the process.
Used by the engine, the worker, the gateway and ``asyncinfer up``; imports nothing of asyncinfer."""
