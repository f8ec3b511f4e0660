"""Triton's ModelConfig as generated protobuf messages (model_config.proto, Triton's own with its
package renamed so that it never clashes with tritonclient's copy in one process; regenerate with
`make proto`): a repository's ``config.pbtxt`` is read as its text format (models/triton_config.py)."""
