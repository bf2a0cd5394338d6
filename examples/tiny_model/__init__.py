"""The tiny V4.1 model: corpus, tokenizer, backbone and DSpark training, export, evaluation.

Scripts run from the repository root as ``python -m examples.tiny_model.<script>``."""
