"""The object store that holds tensors too large for a message (fsspec: a shared folder, ``s3://``
and any other fsspec URL): asyncinfer/store/tensor_store.py."""
