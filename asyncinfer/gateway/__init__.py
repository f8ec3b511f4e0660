"""The Open Inference Protocol v2 (KServe; Triton's extensions) over HTTP and gRPC in front of the
fleet: ``asyncinfer gateway``. Each infer call becomes one ``asyncinfer.infer`` request."""
