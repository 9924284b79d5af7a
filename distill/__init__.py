"""Core of the distillation stream: wire protocol, transport, spool and config (no vLLM imports)."""

__version__ = "0.1.0"
