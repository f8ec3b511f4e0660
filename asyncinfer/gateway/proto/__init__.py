"""Generated protobuf messages of the gRPC front (inference.proto; regenerate with `make proto`)."""
