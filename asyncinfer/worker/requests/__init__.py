"""The requests a device worker holds: a taken message with its bookkeeping, the account of what is
held, the first attempts counted towards the retry budget, and the sequences pinned to it."""
