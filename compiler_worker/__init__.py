"""The compiler worker: the compile pipeline as plain functions, graph passes, backends,
verification and benchmarking. The Celery tasks that drive it stay thin.
"""
