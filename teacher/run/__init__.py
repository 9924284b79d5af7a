"""The phases of one `distill-teacher` run, driven by teacher/cli.py: `preflight` (checks before vLLM),
`generate` (GENERATE: rows through vLLM with the connector), `serve` (SERVE: this process's own
Publisher replays the spool and sends END) and `state` (the run's counters, summary JSON, exit codes
and signal handler)."""
