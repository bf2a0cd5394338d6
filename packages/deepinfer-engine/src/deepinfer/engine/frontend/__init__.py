"""The user-facing side of the engine: ``LLM``, prompt and parameter normalisation, request
validation, chat encoding and parsing, and the outputs built from the scheduler's updates."""
