"""Pipeline parallelism: schedules as data (this package's schedule.py)."""
