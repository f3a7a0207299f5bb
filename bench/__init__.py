"""Benchmarks that compare Headroom with mlx_lm.server and with mlx-lm driven in-process.

Run ``python -m bench serve --help``. The load generator runs in the bench process; the
servers under test run as subprocesses; the in-process system is mlx-lm's BatchGenerator
stepped directly in this process, the floor of serving overhead. See bench/README.md.
"""
