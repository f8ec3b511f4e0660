"""Operations: the CLI, ``asyncinfer up``, status, the demo, the embedded Redis."""
