"""Jobs over files: every row of a Parquet, JSON Lines or CSV file (or a folder of ``.npy``
files) through a model, written beside the rows, resumable under the job's ID (docs/jobs.md)."""

from asyncinfer.client.jobs.record import JobStatus
from asyncinfer.client.jobs.runner import JobCancelled, JobResult, run_job

__all__ = ["JobCancelled", "JobResult", "JobStatus", "run_job"]
