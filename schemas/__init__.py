"""Kiln's wire models (pydantic v2). No I/O, and nothing else of ours is imported here.

Each model lives in its module (``schemas.options.CompileOptions``, ``schemas.jobs.JobStatus``,
...). This package's own module imports nothing: every Kiln process, and every sandboxed child
before it confines itself, imports ``schemas.errors``, and a re-export here would make each
one build every model.
"""
