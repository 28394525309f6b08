"""`resil-run`, on the launch host (a laptop, the Slurm batch host).

Parses the command line, starts the controller (and standbys), the node processes
(locally, or one `srun` step under Slurm), cold spares (`--spare-target`) and joins
(`--join`), and prints the live line and the summary.
"""
