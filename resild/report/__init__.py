"""`resild report`: offline, reads a job's event log and splits its wall time into
productive steps, start-up and each recovery's phases (tables, --json, plots).
Runs in no job process.
"""
