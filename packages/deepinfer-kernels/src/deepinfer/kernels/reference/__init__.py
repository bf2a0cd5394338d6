"""Plain-PyTorch reference twins of every op: the semantics every backend must reproduce."""
