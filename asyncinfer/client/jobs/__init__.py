"""Jobs over files: every row of a Parquet, JSON Lines or CSV file (or a folder of ``.npy`` files)
through a model, written beside the rows, resumable under the job's ID (docs/jobs.md); and the
window that ``Client.map`` shares with them (windowed.py)."""
