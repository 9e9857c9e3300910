"""The job's configuration: its sections (job), TOML and command-line loading (load), and every
check that needs no process group (preflight)."""
