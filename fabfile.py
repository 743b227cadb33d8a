from tasks import ns  # noqa: F401  (Fabric looks for fabfile.py; the tasks live in tasks.py)
